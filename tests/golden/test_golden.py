"""Each data stage's output on the fixture cases equals its reviewed golden file."""

from __future__ import annotations

import difflib
from functools import cache

import pytest

from tests.golden.harness import CASES, STAGES, Case, expected_path, rendered_files


@cache
def _generated(case: Case) -> dict[str, str]:
    return rendered_files(case)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_stage_output_matches_golden_file(case, stage):
    path = expected_path(case, stage)
    assert path.is_file(), f"{path} is missing; run `python -m tests.golden.regenerate` and review it"
    expected, actual = path.read_text(encoding="utf-8"), _generated(case)[stage]
    if actual != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True), "golden", "now", n=1))
        pytest.fail(
            f"{case.name}/{stage} differs from {path} (review, then `python -m tests.golden.regenerate`):\n{diff[:4000]}"
        )


def test_cases_are_disjoint_and_all_have_inputs():
    names = [c.name for c in CASES]
    assert len(set(names)) == len(names)
    for case in CASES:
        assert (expected_path(case, "render").parent.parent.parent / "cases" / f"{case.name}.jsonl").is_file()


def test_the_packed_case_puts_several_documents_in_one_row():
    import json

    pack = json.loads(expected_path(next(c for c in CASES if c.name == "packed"), "pack").read_text())
    assert max(len(row["documents"]) for row in pack["rows"]) >= 2
    assert all(max(row["document_ids"]) == len(row["documents"]) for row in pack["rows"])
