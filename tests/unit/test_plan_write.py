"""The plan write is retried like any storage stage, and a run that fails early still names its run id.

One lost answer during the plan's upload used to fail the whole run
(`plan-write` had no retries) with `run_id: null` in its summary line. The
references: Prefect's own task-run record (run count, final state), the plan
bundle actually in the store, and the run id the plan computes by itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prefect import flow

import flows.pipeline
from flows.pipeline import RunFailed, train_flow
from infra.runs import ledger
from infra.runs.run_state import PLAN_BUNDLE, stored_bundle
from infra.store import open_store
from tasks import plan as plan_stage
from tasks.plan import compute_plan_fn, write_plan_task
from tests.e2e.flows.prefect_queries import task_runs_of


def _fail_first(calls: list, real):
    def publish(planned):
        calls.append(planned.run_id)
        if len(calls) == 1:
            raise ConnectionError("object storage at the store is unreachable (the answer to the upload was lost)")
        return real(planned)

    return publish


@flow(name="plan-write-once")
def write_the_plan(config):
    return write_plan_task.with_options(retry_delay_seconds=0)(config, compute_plan_fn(config), return_state=True)


def test_a_lost_answer_during_the_plan_upload_is_retried_and_the_plan_is_stored(
    prefect_harness, tiny_config, monkeypatch
):
    calls: list = []
    monkeypatch.setattr(plan_stage, "publish_plan", _fail_first(calls, plan_stage.publish_plan))
    state = write_the_plan(tiny_config)
    assert state.is_completed(), state.message
    planned = state.result()
    task_run = next(t for t in task_runs_of(state.state_details.flow_run_id) if t.name.startswith("plan-write"))
    assert task_run.run_count == 2 and len(calls) == 2  # Prefect retried it once
    assert stored_bundle(open_store(tiny_config.storage.url), planned.run_id, PLAN_BUNDLE) is not None
    failed = [e for e in ledger.read(Path(planned.run_dir)) if e["status"] == "failed"]
    assert [(e["stage"], e["failure"]["attempt"], e["failure"]["retried"]) for e in failed] == [("plan-write", 1, True)]


def test_a_run_that_fails_at_the_plan_write_keeps_its_run_id(prefect_harness, tiny_config, monkeypatch):
    def store_never_answers(planned):
        raise ConnectionError("object storage at the store is unreachable")

    monkeypatch.setattr(plan_stage, "publish_plan", store_never_answers)
    monkeypatch.setattr(flows.pipeline, "write_plan_task", write_plan_task.with_options(retry_delay_seconds=0))
    expected = compute_plan_fn(tiny_config).run_id  # what the plan names the run, computed on its own
    with pytest.raises(RunFailed) as raised:
        train_flow(tiny_config)
    summary = raised.value.summary
    assert summary["run_id"] == expected
    assert (summary["failed_stage"], summary["failure_cause"]) == ("plan-write", "storage_outage")
    attempts = write_plan_task.retries + 1
    failed = [e for e in ledger.read(Path(tiny_config.run.work_dir) / expected) if e["status"] == "failed"]
    assert [e["failure"]["attempt"] for e in failed] == list(range(1, attempts + 1))
