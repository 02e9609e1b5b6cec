"""Shared fixtures: a tiny run config on the shipped example, and the Prefect harness; the suite's tiers."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from trainer_core.config import RunConfig, config_from_dict

pytest_plugins = ["tests.s3_fixture", "tests.postgres_fixture", "tests.terminal_signals"]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

HEAVY_MARKERS = ("flow", "s3", "distributed", "postgres", "ui")
"""The tiers that start a real server, a Prefect flow, torchrun or a browser; `fast` is every test with none of them."""
FIXTURE_MARKERS = {"prefect_harness": "flow", "s3_server": "s3", "postgres_cluster": "postgres"}
"""A test that uses one of these fixtures (directly or through another) starts that server: it gets the marker."""


def _derived_markers(item: pytest.Item) -> set[str]:
    """The heavy markers a test earns by what it uses, whether or not its module says so."""
    names = {FIXTURE_MARKERS[name] for name in getattr(item, "fixturenames", ()) if name in FIXTURE_MARKERS}
    callspec = getattr(item, "callspec", None)
    # A store fixture parametrized over local and s3 asks for the server lazily (request.getfixturevalue):
    # its "s3" case is known by its parameter id only.
    if callspec is not None and "s3" in re.split(r"[-\[\]]", callspec.id):
        names.add("s3")
    if "e2e" in Path(str(item.fspath)).parts:
        names.add("e2e")
    return names


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Apply the tier markers: the derived heavy ones, then `fast` to every test left without one; then run the
    heaviest files first (`heaviest_files_first`)."""
    for item in items:
        for name in sorted(_derived_markers(item) - {mark.name for mark in item.iter_markers()}):
            item.add_marker(name)
        if not any(item.get_closest_marker(name) for name in (*HEAVY_MARKERS, "e2e")):
            item.add_marker("fast")
    items[:] = heaviest_files_first(items)


FILE_WEIGHT = ("e2e", "distributed", "flow", "postgres", "ui", "s3")
"""What a file holds, heaviest first: whole programs, torchrun launches, flows and servers, then the S3 cases."""


def heaviest_files_first(items: list) -> list:
    """The items file by file, the files with the heaviest tests first, each file's tests in their own order.

    The suite's workers (pytest-xdist, `--dist loadfile`) take files in this order as they become free: the long
    whole-program files start first, and the many short unit files fill in at the end, so neither worker is left
    running one long file alone while the other has finished."""

    def weight(item) -> int:
        marked = [index for index, name in enumerate(FILE_WEIGHT) if item.get_closest_marker(name)]
        return min(marked, default=len(FILE_WEIGHT))

    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    order = sorted(by_file, key=lambda path: min(weight(item) for item in by_file[path]))  # stable: ties keep order
    return [item for path in order for item in by_file[path]]


def tiny_tree(tmp_path: Path, **sections) -> dict:
    """A small, fast config tree over the shipped example data; sections override keys."""
    tree = {
        "run": {"name": "test", "seed": 7, "work_dir": str(tmp_path / "work")},
        "model": {"config": str(EXAMPLES / "tiny" / "model_config.json")},
        "tokenizer": {"path": str(EXAMPLES / "tiny" / "tokenizer.json")},
        "data": {"path": str(EXAMPLES / "tiny" / "sft.jsonl"), "max_seq_len": 128},
        "train": {
            "steps": 6,
            "steps_per_segment": 3,
            "global_batch_size": 8,
            "learning_rate": 3e-3,
            "logical_dp": 2,
            "nproc_per_node": 2,
            "segment_timeout_s": 300,
        },
        "storage": {"url": str(tmp_path / "store")},
    }
    for section, values in sections.items():
        tree.setdefault(section, {}).update(values)
    return tree


SUITE_THREADS = 1
"""Intra-op threads of torch in the test process. The suite's models are tiny: a second thread saves nothing, and on a
loaded machine (other processes on the cores) every parallel kernel waits at OpenMP's barrier for a descheduled
thread, 10-20 times slower (a tiny forward/backward: 0.02 s at 1 thread, 0.1-0.4 s at 2 under load 2). Child
processes (torchrun ranks, `rankflow`) keep their own counts: OMP_NUM_THREADS is not set here."""


@pytest.fixture(autouse=True)
def _one_thread():
    """Each test starts at SUITE_THREADS; a segment or worker run in-process pins its threads
    (trainer_core.ranks.pin_threads, OMP_NUM_THREADS included), and later tests get the suite's count and the variable
    back."""
    import torch

    env = os.environ.get("OMP_NUM_THREADS")
    if torch.get_num_threads() != SUITE_THREADS:
        torch.set_num_threads(SUITE_THREADS)
    yield
    if torch.get_num_threads() != SUITE_THREADS:
        torch.set_num_threads(SUITE_THREADS)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env


@pytest.fixture
def tiny_config(tmp_path: Path) -> RunConfig:
    return config_from_dict(tiny_tree(tmp_path), config_dir=tmp_path)


HARNESS_START_S = 300


@pytest.fixture(scope="session")
def prefect_harness():
    """One temporary Prefect API for the whole session (starting one takes ~15 s; minutes on a loaded machine: the
    bound only ends a start that hangs, the wait ends when the server answers)."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(HARNESS_START_S))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # as rankflow's own commands do
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=HARNESS_START_S):
        yield


def copy_example(tmp_path: Path) -> Path:
    """A private copy of the example directory, for tests that edit inputs."""
    target = tmp_path / "examples"
    shutil.copytree(EXAMPLES, target)
    return target
