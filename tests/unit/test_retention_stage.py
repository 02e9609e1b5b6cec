"""The retention stage as the flow calls it: retried, and its failure never the commit's (a lost run lease still is).

Runs the real Prefect task (`tasks.retention.retain`) on a local store with two
committed checkpoints; the failure is injected into the store removal, and
the checkpoints are checked in the store afterwards.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import infra.publication.retention as retention_module
import tasks.retention as retention_stage
from infra.publication.checkpoints import list_checkpoints
from infra.publication.commit import CommitOutcome, commit_checkpoint
from infra.runs import ledger
from infra.runs.run_lease import RunLeaseLost
from infra.store import open_store
from tasks.outcomes import PlannedRun
from tests.publication_helpers import RUN, random_files, stage
from trainer_core.config import StorageSection


@pytest.fixture
def planned(tmp_path) -> PlannedRun:
    store = open_store(str(tmp_path / "store"))
    for step in (3, 6):
        commit_checkpoint(stage(tmp_path, step, random_files(1, 800)), store, RUN)
    (tmp_path / "work" / RUN).mkdir(parents=True)
    return PlannedRun(
        run_id=RUN,
        digest="d" * 64,
        run_dir=str(tmp_path / "work" / RUN),
        segment_steps=[(0, 3), (3, 6)],
        storage=StorageSection(url=str(tmp_path / "store"), keep_last=1),
    )


def committed_at(step: int) -> CommitOutcome:
    return CommitOutcome(
        checkpoint_url=f"file:///{step}", step=step, num_files_uploaded=0, num_files_skipped=0,
        bytes_uploaded=0, latest_moved=True, wall_s=0.0,
    )  # fmt: skip


@pytest.fixture
def no_retry_delay(monkeypatch):
    monkeypatch.setattr(retention_stage, "retain", retention_stage.retain.with_options(retry_delay_seconds=0))


def test_a_retried_retention_removes_what_it_should(prefect_harness, planned, no_retry_delay, monkeypatch):
    real, calls = retention_module.remove_files, []

    def fails_once(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise ConnectionError("store unreachable")
        return real(*args, **kwargs)

    monkeypatch.setattr(retention_module, "remove_files", fails_once)
    report = retention_stage.apply_retention_after(planned, committed_at(6))
    assert report is not None and report.removed == ["step-00000003"]
    assert list_checkpoints(open_store(planned.storage), RUN) == ["step-00000006"]


def test_a_failed_retention_is_a_warning_and_the_commit_stands(prefect_harness, planned, no_retry_delay, monkeypatch):
    def always_fails(*args, **kwargs):
        raise ConnectionError("store unreachable")

    monkeypatch.setattr(retention_module, "remove_files", always_fails)
    assert retention_stage.apply_retention_after(planned, committed_at(6)) is None  # no exception: the run goes on
    assert list_checkpoints(open_store(planned.storage), RUN) == ["step-00000006"]  # step 3 hidden, step 6 kept
    failed = [e for e in ledger.read(Path(planned.run_dir)) if e["stage"] == "retention" and e["status"] == "failed"]
    assert len(failed) == 3  # the first try and its two retries
    monkeypatch.undo()
    assert retention_stage.apply_retention_after(planned, committed_at(6)).removed == ["step-00000003"]  # catches up


def test_a_lost_run_lease_still_ends_the_run(prefect_harness, planned, no_retry_delay, monkeypatch):
    def fenced(*args, **kwargs):
        raise RunLeaseLost("another run holds the run lease")

    monkeypatch.setattr("tasks.stage.fence", fenced)  # the stage envelope fences on entry
    with pytest.raises(RunLeaseLost):
        retention_stage.apply_retention_after(planned, committed_at(6))
    assert list_checkpoints(open_store(planned.storage), RUN) == ["step-00000003", "step-00000006"]
