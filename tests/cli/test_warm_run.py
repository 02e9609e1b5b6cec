"""`rankflow run` with warm ranks: the same checkpoint, bitwise, as ranks started anew, and nothing left running.

Two real `rankflow` processes on the same tiny config (2 segments of 2 gloo
ranks, then an export), one as a user runs it (the run's warm process forks
every rank) and one with `RANKFLOW_WARM_RANKS=0` (every rank imports by
itself, as before warm processes), side by side (each in directories of its
own, with its own temporary Prefect server; nothing asserted depends on
timing). The reference is the second run: its
committed weights and its losses. The progress records say which ranks were
forked; a child subreaper (tests/cli/watch_exit.py) finds what the command
left running.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from infra.launch.warm_ranks import DISABLE_ENV
from tests.cli.watched_run import watched_rankflow_run
from tests.conftest import tiny_tree
from trainer_core.run.progress import export_progress_path, progress_path

pytestmark = [pytest.mark.flow, pytest.mark.distributed]


def _run(root: Path, warm: bool) -> dict:
    root.mkdir()
    tree = tiny_tree(root, train={"steps": 4, "steps_per_segment": 2, "global_batch_size": 4})
    watched = watched_rankflow_run(root, tree, {DISABLE_ENV: "1" if warm else "0"})
    assert watched["returncode"] == 0, watched["stderr"][-3000:]
    summary = json.loads(watched["stdout"].strip().splitlines()[-1])
    run_dir = Path(tree["run"]["work_dir"]) / summary["run_id"]
    ready = [
        json.loads(line)
        for path in (progress_path(run_dir, 0), progress_path(run_dir, 1), export_progress_path(run_dir, 1))
        for line in path.read_text().splitlines()
        if '"ready"' in line
    ]
    weights = Path(summary["checkpoint_url"]) / "model.safetensors"
    return {
        "summary": summary,
        "ready": ready,
        "weights": weights.read_bytes(),
        "left": watched["left_behind"],
        "output": watched["stdout"] + watched["stderr"],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("warm-run")
    # Side by side: each run waits most of its time on its own Prefect server's start and its ranks' imports.
    with ThreadPoolExecutor(max_workers=2) as pool:
        warm, anew = pool.submit(_run, root / "warm", True), pool.submit(_run, root / "anew", False)
        return {"warm": warm.result(), "anew": anew.result()}


def test_a_run_with_warm_ranks_commits_bitwise_what_ranks_started_anew_commit(runs):
    warm, anew = runs["warm"], runs["anew"]
    assert warm["summary"]["run_id"] == anew["summary"]["run_id"]
    assert warm["summary"]["losses"] == anew["summary"]["losses"] and len(warm["summary"]["losses"]) == 4
    assert warm["weights"] == anew["weights"]


def test_every_launch_of_a_run_is_forked_warm_and_none_without(runs):
    assert len(runs["warm"]["ready"]) == 3 and len(runs["anew"]["ready"]) == 3  # two segments and the export
    segments_warm = [r for r in runs["warm"]["ready"] if "phases" in r]
    assert segments_warm and all("forked" in r["phases"] for r in segments_warm)
    assert all("forked" not in r.get("phases", {}) for r in runs["anew"]["ready"])


def test_the_warm_process_does_not_outlive_the_command(runs):
    assert runs["warm"]["left"] == []


def test_a_forked_rank_prints_no_more_than_a_rank_started_anew(runs):
    assert "Warning" not in runs["warm"]["output"], [
        line for line in runs["warm"]["output"].splitlines() if "Warning" in line
    ]
