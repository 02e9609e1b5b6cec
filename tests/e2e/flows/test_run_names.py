"""Task runs are named for what they are, and flow-run log lines carry the run's name once the plan gives it.

Read back from the Prefect API (task run names) and from the log records
Prefect's own loggers emit (the `flow_run_name` / `task_run_name` each
console line is formatted with), under the Prefect test harness.
"""

from __future__ import annotations

import logging
import re

import pytest

from flows.pipeline import train_flow
from tests.conftest import tiny_tree
from tests.e2e.flows.prefect_queries import flow_runs_named, task_runs_of
from trainer_core.config import config_from_dict

pytestmark = [pytest.mark.flow, pytest.mark.distributed]

_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{3}$")  # what Prefect appends to a task run without a name of its own


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def named_run(prefect_harness, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("names")
    config = config_from_dict(
        tiny_tree(
            tmp_path,
            run={"name": "names"},
            train={"steps": 2, "steps_per_segment": 2, "nproc_per_node": 1, "logical_dp": 1},
        ),
        config_dir=tmp_path,
    )
    handler = _Records()
    loggers = [logging.getLogger(name) for name in ("prefect.flow_runs", "prefect.task_runs")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        result = train_flow(config)
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert result["status"] == "completed"
    return result, handler.records


def test_every_task_run_is_named_for_its_stage_and_subject_without_a_random_suffix(named_run):
    result, _ = named_run
    run_id = result["run_id"]
    names = {t.name for t in task_runs_of(flow_runs_named(run_id)[0].id)}
    assert {
        "storage-check",
        "plan-names",
        f"plan-write-{run_id}",
        "segment-0 steps 0-1",
        "export-segment-0",
        "commit-step-2",
        "cleanup-step-2",
        f"report-{run_id}",
    } <= names, names
    assert not [name for name in names if _RANDOM_SUFFIX.search(name)], names


def test_flow_run_log_lines_carry_the_run_id_once_the_plan_names_the_run(named_run):
    result, records = named_run
    run_id = result["run_id"]
    # The run is renamed before the plan-write task starts (its lease is taken for the run id first).
    renamed_at = next(i for i, r in enumerate(records) if getattr(r, "task_run_name", "").startswith("plan-write-"))
    flow_lines = [r for r in records[renamed_at:] if r.name == "prefect.flow_runs" and hasattr(r, "flow_run_name")]
    assert any("Finished in state" in r.getMessage() for r in flow_lines)  # the engine's own last line
    stale = [f"{r.flow_run_name}: {r.getMessage()}" for r in flow_lines if r.flow_run_name != run_id]
    assert stale == [], f"flow-run log lines after the rename still carry the planning name: {stale}"
    before = [r for r in records[:renamed_at] if r.name == "prefect.flow_runs" and hasattr(r, "flow_run_name")]
    assert before and {r.flow_run_name for r in before} == {"names (planning)"}
    segment_lines = [r for r in records if getattr(r, "task_run_name", "") == "segment-0 steps 0-1"]
    assert any("[rank 0]" in r.getMessage() for r in segment_lines)  # rank lines carry their stage's task run name
