"""A flow run started again (Retry in the UI) keeps one artifact per key, and a completed run settles its failure report.

Retry in the UI re-runs the same flow run: its artifacts used to be created
again, so a Completed run showed two progress bars, two metrics tables and the
old failure report as if it were current. Here the retry is what the UI does
(the flow run set to AwaitingRetry, then run again by the engine) with the
real artifact code of the pipeline (`tasks.live`, `tasks.failure_report`,
the `report` task); the reference is what the Prefect API lists for the flow run.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.flow_engine import run_flow
from prefect.states import AwaitingRetry

from tasks.failure_report import report_failure
from tasks.live import create_live_artifacts, show_steps_done
from tasks.outcomes import PlannedRun, SegmentOutcome
from tasks.report import report
from tests.e2e.flows.prefect_queries import artifacts_of
from trainer_core.config import TrainSection
from trainer_core.run.plan import run_dir_for

RUN_ID = "test-0123456789ab"


def _segment(index: int) -> SegmentOutcome:
    return SegmentOutcome(
        segment=index,
        start_step=3 * index,
        end_step=3 * index + 3,
        losses=[2.0 - index, 1.9 - index, 1.8 - index],
        num_tokens=100,
        tokens_per_s=1000.0,
        train_s=0.1,
        launch_wall_s=1.0,
        reused=False,
    )


@flow(name="retried-in-the-ui")
def run_once(planned: PlannedRun, marker: str) -> dict:
    live = create_live_artifacts(planned.run_id, planned.total_steps, steps_done=0)
    show_steps_done(live, 3)
    if not Path(marker).exists():  # the first run fails at segment 1; the retry gets through
        Path(marker).write_text("failed once\n")
        report_failure(
            Path(planned.run_dir), planned.run_id, "segment", ConnectionError("object storage went away"), segment=1
        )
        raise RuntimeError("segment 1 failed")
    show_steps_done(live, 6)
    return report(planned, [_segment(0), _segment(1)], [])


def test_a_ui_retry_leaves_one_artifact_per_key_and_settles_the_failure_report(prefect_harness, tiny_config, tmp_path):
    planned = PlannedRun(
        run_id=RUN_ID,
        digest="d" * 64,
        run_dir=str(run_dir_for(tiny_config, RUN_ID)),
        segment_steps=[(0, 3), (3, 6)],
        train=TrainSection(segment_timeout_s=60),
        storage=tiny_config.storage,
    )
    parameters = {"planned": planned, "marker": str(tmp_path / "failed-once")}
    first = run_once(**parameters, return_state=True)
    assert first.is_failed()
    flow_run_id = first.state_details.flow_run_id
    assert len(artifacts_of(flow_run_id)[f"{RUN_ID}-failure"]) == 1

    with get_client(sync_client=True) as client:  # what Retry in the UI does
        client.set_flow_run_state(flow_run_id, AwaitingRetry(), force=True)
        flow_run = client.read_flow_run(flow_run_id)
    second = run_flow(run_once, flow_run=flow_run, parameters=parameters, return_type="state")
    assert second.is_completed(), second.message

    artifacts = artifacts_of(flow_run_id)
    counts = {key: len(found) for key, found in artifacts.items() if key is not None}  # (None: Prefect's result record)
    assert counts == {f"{RUN_ID}-{what}": 1 for what in ("progress", "metrics", "failure", "segments", "checkpoint")}
    assert artifacts[f"{RUN_ID}-progress"][0].data == 100.0
    failure = artifacts[f"{RUN_ID}-failure"][0]
    assert failure.data.startswith("## Settled: the run completed after this failure")
    assert "## segment failed" in failure.data and "storage_outage" in failure.data  # what failed, still there
