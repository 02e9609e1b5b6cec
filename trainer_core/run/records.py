"""The records a launch leaves for the orchestrator: one schema on both sides of the process boundary.

Rank 0 of a segment writes `SegmentResult` (`RUN/segments/segment-NNNN.json`),
rank 0 of an export `ExportResult` (`RUN/export/step-N.result.json`), and the
pipeline's training state carries `StateMeta` (`meta.json`). The tasks read
them back through the same models: strict types, no unknown key, so a field
renamed on one side fails at the read, naming the field.

Written with `json.dumps(model.model_dump(), …)` in the field order below,
which is the key order of the files written before these models: the bytes are
the same. Never `model_dump_json`: it writes NaN as null, and a NaN loss is a
legal figure of a skipped step (tests/trainer/test_segment_nonfinite.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Self

from pydantic import BaseModel, ConfigDict

from ..files import write_text_atomic
from .layout import RunDir


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    def to_json(self) -> str:
        return json.dumps(self.model_dump(), indent=2)

    def write(self, path: Path) -> None:
        write_text_atomic(path, self.to_json())

    @classmethod
    def from_json(cls, text: str | bytes) -> Self:
        return cls.model_validate(json.loads(text))  # json.loads reads NaN and Infinity, as json.dumps wrote them

    @classmethod
    def read(cls, path: Path) -> Self:
        return cls.from_json(path.read_text())


class PlannerSummary(_Record):
    """The memory planner's choices, misses and measured costs (`MemoryPlanner.summary()`)."""

    choices: dict[str, int]
    num_misses: int
    miss_reports: list[str]
    budget_bytes: int | None
    forward_s_per_token: float | None
    pack_s_per_byte: float | None
    restore_s_per_byte: float | None


class SegmentResult(_Record):
    """What one segment launch did: rank 0 writes it after the state is saved."""

    segment: int
    start_step: int
    end_step: int
    losses: list[float]
    """Per step, the loss per loss token of the global batch (NaN where a rank's loss was not finite)."""
    grad_norms: list[float]
    learning_rates: list[float] = []
    """Per step, the learning rate of the run's checkpoint (absent from results written before lr_schedule: [])."""
    eval_steps: list[int] = []
    """The steps after which the held-out rows were evaluated (`train.eval_every`, and the segment's last step)."""
    eval_losses: list[float] = []
    """The eval loss after each of `eval_steps` (`trainer_core.run.evaluation`); [] without held-out data."""
    skipped_steps: list[int]
    num_skipped_steps: int
    num_stale_trajectories: int
    num_tokens: int
    """Input tokens trained on (every logical rank)."""
    num_token_slots: int = 0
    """Positions the forwards ran over, padding included: each step's logical ranks' rows cut to their own
    longest (`trainer_core.data.trim`); `num_tokens / num_token_slots` is the share of work that was not padding
    (absent from results written before the cut: 0)."""
    tokens_per_s: float
    setup_s: float
    train_s: float
    save_s: float
    peak_saved_bytes: int
    planner_misses: int = 0
    """Summed over ranks (absent from results written before the memory planner: 0)."""
    planner: PlannerSummary | None = None
    """Rank 0's planner (absent from results written before the memory planner)."""
    world_size: int
    logical_dp: int
    reduction: str
    threads_per_process: int
    state_dir: str
    state_bytes: int


class ExportResult(_Record):
    """What one export launch staged: rank 0 writes it beside the staged directory."""

    segment: int
    step: int
    out_dir: str
    reused: bool
    """The staged directory's manifest already verified with the same weights: nothing was serialized again."""
    weights_sha256: str
    export_s: float


class StateMeta(_Record):
    """The pipeline's `meta.json` in a saved training state (written with sorted keys, as `save_training_state` does)."""

    next_step: int
    segment: int
    plan_digest: str


def export_result_path(out_dir: Path) -> Path:
    """Where the export staged at `out_dir` leaves its `ExportResult`."""
    return RunDir.export_result_file(out_dir)
