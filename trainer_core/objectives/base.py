"""What a training objective is to the segment loop: the `Objective` protocol.

An objective turns one logical rank's managed logprobs and shard rows into a
loss *sum* over its loss tokens (the loop divides by the loss tokens of the
whole global batch, so the loss does not depend on the split over ranks), plus
named per-step sums (`figures`) that the loop reduces over logical ranks, in
logical order, beside its own (`trainer_core.run.figures.FigureLayout`).
`step_figures` turns the reduced sums into the figures of the step's progress
record, and `live_columns` says how the live metrics table shows them
(`tasks.live`). `needs` names the shard tensors it reads: a config whose data
do not carry them is refused before anything is planned.

Adding an objective: one module with a class that satisfies this protocol,
and its line in `trainer_core.objectives.OBJECTIVES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    import torch

    from ..config import RunConfig


@dataclass(frozen=True)
class LossSum:
    """One logical rank's loss sum and what it counted on the way."""

    loss: "torch.Tensor"
    """Sum over the kept loss tokens (a graph: the loop runs its backward)."""
    figures: dict[str, float] = field(default_factory=dict)
    """This rank's share of each of the objective's `figures` (summed over logical ranks by the loop)."""
    num_dropped: int = 0
    """Trajectories left out of the loss (stale): counted in the step record and the segment result."""


@dataclass(frozen=True)
class LiveColumn:
    """How the live metrics table shows one figure of the step record."""

    figure: str
    """The step record's key."""
    column: str
    """The table's column."""
    digits: int
    """Decimal places a float is rounded to."""


class Objective(Protocol):
    name: ClassVar[str]
    """`train.objective`'s value that chooses this objective."""
    figures: ClassVar[tuple[str, ...]]
    """Extra per-step sums, reduced over logical ranks in this order."""
    needs: ClassVar[tuple[str, ...]]
    """Shard tensors `loss_sum` reads (`trainer_core/data/shards.py`)."""
    live_columns: ClassVar[tuple[LiveColumn, ...]]
    """The step figures the live metrics table shows, in column order."""

    @classmethod
    def from_config(cls, config: "RunConfig") -> "Objective": ...

    def loss_sum(self, logprobs: "torch.Tensor", rows: Mapping[str, "torch.Tensor"], *, revision: int) -> LossSum:
        """`logprobs[:, t-1]` is the logprob of target t; `rows` are aligned per target token (hence `[:, 1:]`).

        `revision` counts the optimizer steps the trained weights have taken.
        """
        ...

    def step_figures(self, sums: Mapping[str, float]) -> dict[str, float | int | None]:
        """The step record's objective figures from the globally reduced sums (the loop's and the objective's)."""
        ...

    def for_evaluation(self) -> "Objective":
        """The objective a held-out loss is measured with (`trainer_core.run.evaluation`): every loss token counts,
        so a bound on what trains (RL's data staleness) drops or refuses nothing there."""
        ...
