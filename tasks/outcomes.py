"""Typed values that travel between the pipeline's tasks."""

from __future__ import annotations

from pydantic import BaseModel


class PlannedRun(BaseModel):
    """What the plan stage decided: where the run lives and how it is cut."""

    run_id: str
    digest: str
    run_dir: str
    num_segments: int
    segment_steps: list[tuple[int, int]]
    """(start, end) optimizer steps of each segment, end exclusive."""
    nproc_per_node: int
    segment_timeout_s: float
    storage_url: str
    storage_timeout_s: float = 1800.0
    """Overall limit of one commit, cleanup or ledger upload (`storage.timeout_s`)."""
    storage_request_timeout_s: float = 60.0
    """Connect/read limit of one S3 request (`storage.request_timeout_s`)."""
    stall_timeout_s: float = 300.0
    """The segment watchdog's limit (train.stall_timeout_s)."""
    export_timeout_s: float = 1800.0
    """Wall-clock limit of an export launch (export.timeout_s)."""
    lease_token: str | None = None
    """The run lease this run holds (infra/run_lease.py); writing stages check it first. None: no lease taken."""
    nnodes: int = 1
    """Nodes each segment runs on (train.nnodes; `tasks.nodes`)."""
    rdzv_endpoint: str | None = None
    """Node 0's rendezvous HOST:PORT (train.rdzv_endpoint); None: a free loopback port for local node launches."""
    node_deployment: str | None = None
    """The per-node deployment the nodes run as (train.node_deployment); None: local node processes."""

    @property
    def total_steps(self) -> int:
        return self.segment_steps[-1][1]


class SegmentOutcome(BaseModel):
    segment: int
    start_step: int
    end_step: int
    losses: list[float]
    num_tokens: int
    tokens_per_s: float
    train_s: float
    launch_wall_s: float
    """Wall time of the torchrun launch (0 when the segment's state was reused)."""
    reused: bool
    planner_misses: int = 0
    """Memory-planner predictions that missed the observed peak, over every rank (reports under RUN_DIR/planner/)."""


class ExportOutcome(BaseModel):
    segment: int
    step: int
    staged_dir: str
    reused: bool
    num_files: int
    num_bytes: int
    launch_wall_s: float
