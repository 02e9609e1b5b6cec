"""Typed values that travel between the pipeline's tasks."""

from __future__ import annotations

from pydantic import BaseModel, Field

from trainer_core.config import ExportSection, StorageSection, TrackingSection, TrainSection


class PlannedRun(BaseModel):
    """What the plan stage decided (where the run lives and how it is cut), and the config sections its tasks read.

    The sections are the run config's own (`RunConfig.train`, `.export`,
    `.storage`), so a limit has its default in one place (trainer_core/config.py);
    a deployed node run gets this as a flow parameter and validates it back.
    """

    run_id: str
    digest: str
    run_dir: str
    segment_steps: list[tuple[int, int]]
    """(start, end) optimizer steps of each segment, end exclusive."""
    lease_token: str | None = None
    """The run lease this run holds (infra/runs/run_lease.py); writing stages check it first. None: no lease taken."""
    train: TrainSection = Field(default_factory=TrainSection)
    """Launch limits and topology: nproc_per_node, nnodes, rdzv_endpoint, node_deployment, segment/stall timeouts."""
    export: ExportSection = Field(default_factory=ExportSection)
    """export.timeout_s limits an export launch."""
    storage: StorageSection
    """The store (`open_store(planned.storage)`) and the limit of one commit, cleanup or upload."""
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    """Where the run's metrics go (infra/tracking), its uri resolved."""

    @property
    def num_segments(self) -> int:
        return len(self.segment_steps)

    @property
    def total_steps(self) -> int:
        return self.segment_steps[-1][1]


class SegmentOutcome(BaseModel):
    segment: int
    start_step: int
    end_step: int
    losses: list[float]
    learning_rates: list[float] = []
    """Per step (empty for a segment trained before results recorded it)."""
    eval_steps: list[int] = []
    eval_losses: list[float] = []
    """The held-out loss after each of `eval_steps` (empty without held-out data)."""
    num_tokens: int
    tokens_per_s: float
    train_s: float
    launch_wall_s: float
    """Wall time of the torchrun launch (0 when the segment's state was reused)."""
    reused: bool
    planner_misses: int = 0
    """Memory-planner predictions that missed the observed peak, over every rank (reports under RUN_DIR/planner/)."""
    tracking_failures: int = 0
    """Steps (or the run's record) that did not reach the tracking backend: an outage is counted, never fatal."""


class ExportOutcome(BaseModel):
    segment: int
    step: int
    staged_dir: str
    reused: bool
    num_files: int
    num_bytes: int
    launch_wall_s: float
