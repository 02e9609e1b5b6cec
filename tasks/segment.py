"""The segment stage: one torchrun launch of the trainer core over a range of steps.

Retried by Prefect; a retry resumes from the previous segment's saved state, and
a segment whose own state is already saved is not trained again.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra import ledger
from trainer_core.segment_main import segment_result_path
from trainer_core.state import has_state, state_dir_for

from ._launch import launch_stage
from ._logging import rank_line_logger
from .outcomes import PlannedRun, SegmentOutcome


def _outcome(result: dict, launch_wall_s: float, reused: bool) -> SegmentOutcome:
    return SegmentOutcome(
        segment=result["segment"], start_step=result["start_step"], end_step=result["end_step"],
        losses=result["losses"], num_tokens=result["num_tokens"], tokens_per_s=result["tokens_per_s"],
        train_s=result["train_s"], launch_wall_s=launch_wall_s, reused=reused,
    )


def train_segment_fn(planned: PlannedRun, segment_index: int, on_line=print) -> SegmentOutcome:
    run_dir = Path(planned.run_dir)
    result_path = segment_result_path(run_dir, segment_index)
    if has_state(state_dir_for(run_dir, segment_index)) and result_path.is_file():
        outcome = _outcome(json.loads(result_path.read_text()), 0.0, reused=True)
        ledger.record(run_dir, "segment", "reused", segment=segment_index)
        return outcome
    launched = launch_stage(planned, "segment", "trainer_core.segment_main", segment_index, [], on_line)
    result = json.loads(result_path.read_text())
    outcome = _outcome(result, launched.wall_s, reused=False)
    ledger.record(run_dir, "segment", "completed", launch_wall_s=launched.wall_s,
                  **{k: v for k, v in result.items() if k not in ("grad_norms",)})
    return outcome


@task(name="segment", task_run_name="segment-{segment_index}", retries=2, retry_delay_seconds=[2, 10], cache_policy=NO_CACHE)
def train_segment(planned: PlannedRun, segment_index: int) -> SegmentOutcome:
    return train_segment_fn(planned, segment_index, on_line=rank_line_logger())
