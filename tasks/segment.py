"""The segment stage: one torchrun launch of the trainer core over a range of steps.

Retried by Prefect when the failure's class says a retry can help
(`tasks.retry_policy`); a retry resumes from the previous segment's saved
state, and a segment whose own state is already saved is not trained again:
its task run ends in the state named "Reused". Saved means in the store, or
durable here and passing its local record's trust rule
(trainer_core/run/state_record.py); the state upload (tasks/state_upload.py)
stores it beside the next segment, which starts from the local state at once.
The inputs a segment lacks locally are fetched from the store, verified. While
it trains, a watchdog ends a launch that stops making progress
(`tasks.watchdog`) and the run's live artifacts follow its steps
(`tasks.live`). With train.nnodes > 1 the launch is one per node, started and
failed together by `tasks.nodes`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from prefect.runtime import task_run
from prefect.states import Completed

from infra.tracking import tracking_sink_for
from trainer_core.run.progress import progress_path
from trainer_core.run.records import SegmentResult
from trainer_core.run.segment_main import segment_result_path
from trainer_core.run.state import has_state, state_dir_for
from trainer_core.run.state_readahead import ReadAheadWhenSaved, read_ahead

from . import upload_hold
from ._launch import launch_stage
from ._logging import rank_line_logger
from .events import SEGMENT_COMPLETED, emit_run_event, flow_run_url
from .fencing import fenced_monitor
from .live import LiveArtifacts, in_prefect_run, publisher_for
from .nodes import launch_segment_nodes, nodes_move_their_files
from .outcomes import PlannedRun, SegmentOutcome
from .retry_policy import retry_if_retriable
from .run_state import fetch_segment_inputs, saved_here, stored_segment_result
from .stage import Stage, stage_task
from .watchdog import SegmentWatch

REUSED = "Reused"
"""State name of a segment task run whose state was already saved (nothing trained)."""


def _outcome(result: SegmentResult, launch_wall_s: float, reused: bool) -> SegmentOutcome:
    return SegmentOutcome(
        segment=result.segment,
        start_step=result.start_step,
        end_step=result.end_step,
        losses=result.losses,
        learning_rates=result.learning_rates,
        eval_steps=result.eval_steps,
        eval_losses=result.eval_losses,
        num_tokens=result.num_tokens,
        tokens_per_s=result.tokens_per_s,
        train_s=result.train_s,
        launch_wall_s=launch_wall_s,
        reused=reused,
        planner_misses=result.planner_misses,
    )


def train_segment_fn(
    planned: PlannedRun, segment_index: int, on_line=print, live: LiveArtifacts | None = None
) -> SegmentOutcome:
    try:
        return _train_segment(planned, segment_index, on_line, live)
    finally:  # however it ends: the previous state's upload, held while this segment loads it, may start
        upload_hold.release(planned.run_dir, segment_index - 1)


def _train_segment(planned: PlannedRun, segment_index: int, on_line, live: LiveArtifacts | None) -> SegmentOutcome:  # noqa: ANN001 - on_line: a line callback
    run_dir = Path(planned.run_dir)
    attempt = Stage.enter(planned, "segment", f"segment {segment_index}")
    result_path = segment_result_path(run_dir, segment_index)
    stored = stored_segment_result(planned, segment_index)
    if stored is None and has_state(state_dir_for(run_dir, segment_index)) and result_path.is_file():
        stored = saved_here(planned, segment_index)  # trained here; its upload had not finished
    if stored is not None:
        outcome = _outcome(stored, 0.0, reused=True)
        attempt.record("reused", segment=segment_index)
        return outcome
    moments_cached = planned.train.nproc_per_node > 1  # several ranks per node read them through the cache
    if segment_index > 0:  # its ranks then load the state from memory (trainer_core/run/state_readahead.py)
        read_ahead(
            state_dir_for(run_dir, segment_index - 1), moments=moments_cached
        )  # started at the previous segment's save, if it ran here
    if not nodes_move_their_files(planned):  # a work pool's nodes fetch their own inputs (tasks.nodes)
        fetch_segment_inputs(planned, segment_index)
    progress_file = progress_path(run_dir, segment_index)
    publisher = publisher_for(live, segment_index)
    tracking = tracking_sink_for(planned, warn=_warning_to_this_run())
    consumers = [publisher, tracking, upload_hold.ReleaseAtFirstStep(run_dir, segment_index - 1)]
    if segment_index + 1 < planned.num_segments:  # the next segment loads this state: read it ahead once saved
        consumers.append(ReadAheadWhenSaved(state_dir_for(run_dir, segment_index), moments=moments_cached))
    watch = SegmentWatch(progress_file, planned.train.stall_timeout_s, on_records=_each(*consumers))
    monitor = fenced_monitor(planned, attempt.what, watch)
    try:
        launch_wall_s = _launch(planned, segment_index, on_line, monitor)
        watch()  # the records written after the last poll
    finally:  # a failed launch's steps are logged too (a retry skips them): the record holds what was trained
        tracking_failures = tracking.close() if tracking is not None else 0
    if publisher is not None:
        publisher.flush()
    # The state is durable here: tasks/state_upload.py stores it beside the next segment (on a work pool whose
    # nodes keep their own work dirs, the node holding global rank 0 has stored it already).
    result = SegmentResult.read(result_path)
    outcome = _outcome(result, launch_wall_s, reused=False).model_copy(update={"tracking_failures": tracking_failures})
    attempt.fence()
    attempt.record(
        "completed",
        launch_wall_s=launch_wall_s,
        tracking_failures=tracking_failures,
        **result.model_dump(exclude={"grad_norms"}),
    )
    if in_prefect_run():
        emit_run_event(
            SEGMENT_COMPLETED,
            planned.run_id,
            loss=outcome.losses[-1],
            segment=segment_index,
            step=outcome.end_step,
            tokens_per_s=outcome.tokens_per_s,
            url=flow_run_url(),
        )
    return outcome


def _launch(planned: PlannedRun, segment_index: int, on_line, monitor) -> float:  # noqa: ANN001 - callbacks
    """Train the segment: one torchrun launch, or one per node (`tasks.nodes`); the launch's wall time."""
    if planned.train.nnodes > 1:
        return launch_segment_nodes(planned, segment_index, on_line, monitor)
    return launch_stage(
        planned,
        "segment",
        "trainer_core.run.segment_main",
        segment_index,
        [],
        on_line,
        timeout_s=planned.train.segment_timeout_s,
        monitor=monitor,
    ).wall_s


def _each(*consumers):
    """One `on_records` that hands the records to every consumer there is."""
    present = [c for c in consumers if c is not None]
    if not present:
        return None

    def consume(records: list[dict]) -> None:
        for consumer in present:
            consumer(records)

    return consume


def _warning_to_this_run():
    """A warning function for another thread: the task run's logger (the Prefect UI), taken here where the run's
    context is, or Python's logging outside a run (task logic called directly)."""
    try:
        from prefect import get_run_logger

        return get_run_logger().warning
    except Exception:  # noqa: BLE001 - MissingContextError
        return logging.getLogger("rankflow.tracking").warning


def _run_name() -> str:
    parameters = task_run.parameters
    start, end = parameters["planned"].segment_steps[parameters["segment_index"]]
    return f"segment-{parameters['segment_index']} steps {start}-{end - 1}"


@stage_task(
    "segment", run_name=_run_name, retries=2, retry_delay_seconds=[2, 10], retry_condition_fn=retry_if_retriable
)
def train_segment(planned: PlannedRun, segment_index: int, live: LiveArtifacts | None = None) -> SegmentOutcome:
    outcome = train_segment_fn(planned, segment_index, on_line=rank_line_logger(), live=live)
    if not outcome.reused:
        return outcome
    # Prefect unwraps a State a task returns: the caller receives its data (the outcome), as annotated.
    return Completed(name=REUSED, data=outcome, message="state already saved; nothing trained")  # pyright: ignore[reportReturnType]
