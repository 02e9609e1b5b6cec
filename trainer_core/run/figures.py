"""A step's figures by name, packed into one float64 tensor for the single ordered reduction over logical ranks.

The loop's own sums (`loss_sum`, `input_tokens`, `token_slots`, `stale_trajectories`) come
first, then the objective's (`Objective.figures`). Every element is folded on
its own (`trainer_core.ranks.reduction.ordered_fold`), so which names a layout
holds changes no bit of another's sum.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

LOOP_FIGURES = ("loss_sum", "input_tokens", "token_slots", "stale_trajectories")
"""What every logical rank contributes to a step, whatever the objective (`token_slots`: the positions its
forward ran over, padding included, after `data.trim.trim_padding`)."""


@dataclass(frozen=True)
class FigureLayout:
    names: tuple[str, ...]

    @classmethod
    def for_objective(cls, objective_figures: tuple[str, ...]) -> "FigureLayout":
        clash = set(LOOP_FIGURES) & set(objective_figures)
        if clash or len(set(objective_figures)) != len(objective_figures):
            raise ValueError(
                f"an objective's figures {objective_figures} repeat a name (or one of {LOOP_FIGURES}); rename them"
            )
        return cls(LOOP_FIGURES + tuple(objective_figures))

    def pack(self, values: Mapping[str, float | torch.Tensor]) -> torch.Tensor:
        """One float64 tensor in layout order; every name must be given (a missing one is a bug, not a zero)."""
        given = set(values)
        if given != set(self.names):
            raise KeyError(f"figures {sorted(given)} do not match the layout {list(self.names)}")
        return torch.tensor([float(values[name]) for name in self.names], dtype=torch.float64)

    def unpack(self, packed: torch.Tensor) -> dict[str, float]:
        if packed.shape != (len(self.names),):
            raise ValueError(f"a tensor of shape {tuple(packed.shape)} does not hold the layout {list(self.names)}")
        return dict(zip(self.names, packed.tolist()))
