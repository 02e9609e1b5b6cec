"""The training pipeline as a Prefect flow: plan → segments → export → commit → cleanup."""

from __future__ import annotations

import time

from prefect import flow

from tasks.export import export_segment
from infra.publication import CommitOutcome
from tasks.outcomes import SegmentOutcome
from tasks.plan import plan_run
from tasks.publish import cleanup, commit
from tasks.report import report
from tasks.segment import train_segment
from trainer_core.config import RunConfig


@flow(name="rankflow-train", log_prints=True)
def train_flow(config: RunConfig) -> dict:
    """Train `config` in segments, exporting and committing checkpoints as configured."""
    started = time.perf_counter()
    planned = plan_run(config)
    segments: list[SegmentOutcome] = []
    commits: list[CommitOutcome] = []
    export_wall_s = 0.0
    for index in range(planned.num_segments):
        segments.append(train_segment(planned, index))
        if config.export_after_segment(index):
            staged = export_segment(planned, index)
            export_wall_s += staged.launch_wall_s
            commits.append(commit(planned, staged))
            cleanup(planned, staged)
    ledger_url = report(planned, segments, commits)
    return {
        "run_id": planned.run_id,
        "status": "completed",
        "checkpoint_url": commits[-1].checkpoint_url,
        "steps": planned.segment_steps[-1][1],
        "losses": [loss for s in segments for loss in s.losses],
        "flow_s": time.perf_counter() - started,
        "launch_wall_s": sum(s.launch_wall_s for s in segments),
        "export_wall_s": export_wall_s,
        "train_s": sum(s.train_s for s in segments),
        "tokens": sum(s.num_tokens for s in segments),
        "tokens_per_s": sum(s.num_tokens for s in segments) / max(1e-9, sum(s.train_s for s in segments)),
        "ledger_url": ledger_url,
    }
