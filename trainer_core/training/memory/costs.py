"""What the planner's cost model reads per forward, and the evidence a backward state reports back.

Each backward state class answers the planner's questions about itself from a
`PlanInputs` (is it available here, what it keeps resident, what it costs in
seconds, why it was or was not chosen), so the planner's rule names no mode;
after a forward or a backward the state reports what was measured as
`Evidence`, which the planner folds into its estimates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .estimates import GraphShape

OffloadTarget = Literal["host", "disk"]
"""Where an offloaded graph's saved tensors go (the planner's cost model names it, so it lives here)."""


@dataclass(frozen=True)
class PlanInputs:
    """One forward as the planner sees it, with a budget to plan for."""

    shape: GraphShape
    resident_bytes: int
    """Resident bytes before this forward: live graphs' saved tensors and weight snapshots."""
    budget_bytes: int
    estimate: float | None
    """Bytes a retained graph of this shape is expected to keep (None: no evidence yet)."""
    estimate_headroom: float
    input_bytes: int
    """Bytes of the forward's inputs: what a copy of them keeps."""
    stale_input_bytes: int
    """What a graph that is not a replay keeps besides its saved tensors (input copies for its replay once stale)."""
    offload_target: OffloadTarget
    offload_frees: bool
    """Whether offloading to `offload_target` frees device memory."""
    copy_s_per_byte: float
    """Pack + restore seconds per byte for where an offload would go (measured, or the target's default)."""
    copy_cost_measured: bool
    forward_s_per_token: float | None

    @property
    def exploring(self) -> bool:
        """No evidence yet for this shape: nothing to compare costs with."""
        return self.estimate is None

    def fits(self, graph_bytes: float) -> bool:
        return self.resident_bytes + graph_bytes <= self.budget_bytes


@dataclass(frozen=True)
class Evidence:
    """What one forward or backward measured (fields left None measured nothing)."""

    forward_s: float | None = None
    """Seconds of a forward with grad, the copies it made excluded."""
    saved_bytes: int | None = None
    """Bytes the graph saved, or would have kept had it been retained."""
    pack: tuple[int, float] | None = None
    """(bytes, seconds) of the copies out of the device."""
    restore: tuple[int, float] | None = None
    """(bytes, seconds) of the copies back."""
