"""The tier markers of tests/conftest.py: which tests the fast tier keeps, which heavy marker a test earns by its fixtures."""

from __future__ import annotations

from types import SimpleNamespace

from tests.conftest import _derived_markers, heaviest_files_first, pytest_collection_modifyitems


class _Item:
    """Just the parts of a pytest.Item the hook reads and writes."""

    def __init__(self, path: str, fixturenames=(), callspec_id: str | None = None, marks=()):
        self.fspath = path
        self.nodeid = f"{path}::test_{id(self)}"
        self.fixturenames = list(fixturenames)
        self.callspec = None if callspec_id is None else SimpleNamespace(id=callspec_id)
        self.marks = [SimpleNamespace(name=name) for name in marks]

    def iter_markers(self):
        return iter(self.marks)

    def get_closest_marker(self, name):
        return next((mark for mark in self.marks if mark.name == name), None)

    def add_marker(self, name):
        self.marks.append(SimpleNamespace(name=name))

    @property
    def names(self) -> set[str]:
        return {mark.name for mark in self.marks}


def test_servers_used_through_fixtures_earn_their_markers():
    assert _derived_markers(_Item("tests/unit/test_x.py", ["tmp_path", "prefect_harness"])) == {"flow"}
    assert _derived_markers(_Item("tests/storage/test_x.py", ["s3_env", "s3_server"])) == {"s3"}
    assert _derived_markers(_Item("tests/e2e/deployments/test_x.py", ["postgres_cluster"])) == {"e2e", "postgres"}
    assert _derived_markers(_Item("tests/storage/test_x.py", ["postgres_cluster"])) == {"postgres"}
    assert _derived_markers(_Item("tests/unit/test_x.py", ["tmp_path"])) == set()


def test_the_s3_case_of_a_local_and_s3_parametrization_is_an_s3_test():
    assert _derived_markers(_Item("tests/storage/test_lease.py", callspec_id="s3")) == {"s3"}
    assert _derived_markers(_Item("tests/storage/test_lease.py", callspec_id="local")) == set()
    assert _derived_markers(_Item("tests/storage/test_x.py", callspec_id="s3-True")) == {"s3"}
    assert _derived_markers(_Item("tests/unit/test_x.py", callspec_id="s3x-local")) == set()


def test_only_tests_without_a_heavy_marker_are_fast():
    unit = _Item("tests/unit/test_x.py", ["tmp_path"])
    marked = _Item("tests/ranks/test_x.py", marks=["distributed"])
    derived = _Item("tests/unit/test_x.py", ["prefect_harness"])
    parametrized = _Item("tests/storage/test_lease.py", callspec_id="s3")
    e2e = _Item("tests/e2e/storage/test_x.py")
    pytest_collection_modifyitems(None, [unit, marked, derived, parametrized, e2e])
    assert unit.names == {"fast"}
    assert marked.names == {"distributed"}
    assert derived.names == {"flow"}
    assert parametrized.names == {"s3"}
    assert e2e.names == {"e2e"}


def test_the_heaviest_files_run_first_each_files_tests_in_order():
    unit_a, unit_b = _Item("tests/unit/test_a.py"), _Item("tests/unit/test_a.py")
    s3 = _Item("tests/storage/test_s.py", marks=["s3"])
    launch_fast = _Item("tests/ranks/test_r.py")  # a file is as heavy as its heaviest test
    launch = _Item("tests/ranks/test_r.py", marks=["distributed"])
    whole = _Item("tests/e2e/test_w.py", marks=["e2e", "flow"])
    ordered = heaviest_files_first([unit_a, s3, launch_fast, unit_b, launch, whole])
    assert ordered == [whole, launch_fast, launch, s3, unit_a, unit_b]
