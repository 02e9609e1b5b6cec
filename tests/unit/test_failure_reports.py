"""Failure reports tell the truth: the stage that failed, one ledger line per attempt, and whether it is retried.

Through the Prefect test harness, with the real `commit` task (its decorator's
retries and retry condition) and a store that never answers: the reference is
Prefect's own record of the task run (its run count and final state) and what
the ledger and the API hold afterwards. No torchrun: the commit fails before
it touches a staged file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prefect import flow

from flows.run_record import RunFailed, RunRecord
from infra.runs import ledger
from tasks import publish, retry_policy
from tasks.outcomes import ExportOutcome, PlannedRun
from tests.e2e.flows.prefect_queries import artifacts_of, task_runs_of
from trainer_core.config import TrainSection
from trainer_core.run.plan import run_dir_for

RUN_ID = "test-0123456789ab"


def _planned(config) -> PlannedRun:
    return PlannedRun(
        run_id=RUN_ID,
        digest="d" * 64,
        run_dir=str(run_dir_for(config, RUN_ID)),
        segment_steps=[(0, 3)],
        train=TrainSection(segment_timeout_s=60),
        storage=config.storage,
    )


def _exported(tmp_path: Path) -> ExportOutcome:
    return ExportOutcome(
        segment=0,
        step=3,
        staged_dir=str(tmp_path / "staged"),
        reused=False,
        num_files=1,
        num_bytes=1,
        launch_wall_s=0.0,
    )


def _retried_cell(markdown: str) -> str:
    """The "retried" column of a failure report's table row."""
    row = next(line for line in markdown.splitlines() if line.startswith("| `"))
    return row.split("|")[5].strip()


@flow(name="failing-commit")
def failing_commit(config, planned: PlannedRun, exported: ExportOutcome) -> dict:
    run = RunRecord(config)
    with run.failures_reported():
        run.planned(planned)  # as the pipeline does once the plan is written
        publish.commit.with_options(retry_delay_seconds=0)(planned, exported)
    return run.outcome()


def test_each_failed_commit_attempt_is_one_ledger_line_and_the_run_names_the_commit(
    prefect_harness, tiny_config, tmp_path, monkeypatch
):
    calls = []

    def store_never_answers(*_args, **_kwargs):
        calls.append(1)
        raise ConnectionError(f"object storage at {tiny_config.storage.url} is unreachable (attempt {len(calls)})")

    monkeypatch.setattr(publish, "commit_checkpoint", store_never_answers)
    # Each attempt fails at its first outage: the 5 minutes an attempt rides out are tests/unit/test_lease_outage_retries.py's.
    monkeypatch.setattr(retry_policy, "OUTAGE_BACKOFF", retry_policy.OutageBackoff(budget_s=0))
    planned = _planned(tiny_config)
    state = failing_commit(tiny_config, planned, _exported(tmp_path), return_state=True)
    assert state.is_failed()
    with pytest.raises(RunFailed) as raised:
        state.result()
    summary = raised.value.summary
    assert (summary["failed_stage"], summary["failure_cause"], summary["run_id"]) == (
        "commit",
        "storage_outage",
        RUN_ID,
    )

    commit_run = next(t for t in task_runs_of(state.state_details.flow_run_id) if t.name == "commit-step-3")
    attempts = commit_run.run_count
    assert attempts == len(calls) == publish.commit.retries + 1 and commit_run.state.is_failed()  # Prefect's own count

    failed = [e for e in ledger.read(Path(planned.run_dir)) if e["status"] == "failed"]
    assert [(e["stage"], e["failure"]["attempt"], e["failure"]["retried"]) for e in failed] == (
        [("commit", n, True) for n in range(1, attempts)] + [("commit", attempts, False)]
    )
    assert all(e["step"] == 3 and e["failure"]["max_attempts"] == attempts for e in failed)
    assert f"attempt {attempts} of {attempts}, not retried: no attempts left" in failed[-1]["error"]
    for entry in failed:  # each attempt's whole error is in its own log file
        log_file = Path(entry["failure"]["log_file"])
        assert log_file.is_file() and f"(attempt {entry['failure']['attempt']})" in log_file.read_text()
        assert "Traceback (most recent call last)" in log_file.read_text()
    assert str(raised.value).startswith(failed[-1]["error"]) and failed[-1]["failure"]["log_file"] in str(raised.value)
    assert summary["failure_log"] == failed[-1]["failure"]["log_file"]

    reports = artifacts_of(state.state_details.flow_run_id)[f"{RUN_ID}-failure"]
    assert len(reports) == 1  # one report per flow run, updated by key at each attempt
    assert "## commit failed (attempt 4 of 4)" in reports[0].data
    assert _retried_cell(reports[0].data).startswith("no: no attempts left")


@flow(name="failing-in-the-flow")
def failing_in_the_flow(config) -> dict:
    run = RunRecord(config)
    with run.failures_reported():
        raise ConnectionError("the flow's own code lost the store")
    return run.outcome()


def test_a_failure_in_the_flow_itself_is_reported_as_not_retried(prefect_harness, tiny_config):
    state = failing_in_the_flow(tiny_config, return_state=True)
    with pytest.raises(RunFailed) as raised:
        state.result()
    assert raised.value.summary["failure_cause"] == "storage_outage"  # a class Prefect retries inside a task…
    report = artifacts_of(state.state_details.flow_run_id)[f"{tiny_config.run.name}-failure"]
    assert len(report) == 1
    # … but nothing retries a flow run: the report must not say it will be.
    assert _retried_cell(report[0].data).startswith("no: nothing retries the flow itself")
    assert "not retried: nothing retries the flow itself" in str(raised.value)
