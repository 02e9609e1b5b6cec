"""Bounded gradient staleness and the importance weight of replayed stale graphs.

A graph's age for a checkpoint is `current revision − recorded revision`.
Past `max_gradient_staleness` (default 2; 0 = strict) backward refuses it; a
replaced checkpoint (new identity) is always refused. Within the bound a stale
graph is differentiated at the weights it ran at, or — with the `importance`
policy — replayed at the current weights with each logprob cotangent scaled by
`clamp(exp(logp_current − logp_recorded), low, high)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .versions import Version


class StaleGraphError(RuntimeError):
    """A graph is too old (or its checkpoint was replaced) to be differentiated."""


@dataclass(frozen=True)
class StalenessPolicy:
    max_gradient_staleness: int = 2
    """Optimizer steps a graph may lag behind; 0 makes every step invalidate older graphs."""
    stale_mode: Literal["snapshot", "importance"] = "snapshot"
    """`snapshot`: differentiate at the recorded weights (kept while such graphs live);
    `importance`: replay at the current weights with importance-weighted logprob cotangents."""
    importance_low: float = 0.0
    importance_high: float = 2.0

    def __post_init__(self) -> None:
        if self.max_gradient_staleness < 0:
            raise ValueError(f"max_gradient_staleness={self.max_gradient_staleness} must be >= 0 (0 = strict)")
        if not 0 <= self.importance_low <= self.importance_high:
            raise ValueError(f"importance clamp [{self.importance_low}, {self.importance_high}] must satisfy 0 <= low <= high")


def graph_age(checkpoint_name: str, recorded: Version, current: Version, policy: StalenessPolicy) -> int:
    """The graph's age in optimizer steps; raises StaleGraphError past the bound."""
    if recorded.identity != current.identity:
        raise StaleGraphError(
            f"checkpoint '{checkpoint_name}' was replaced since this forward ran (recorded {recorded}, now {current}); "
            "a graph of a replaced checkpoint cannot be differentiated — run the forward again"
        )
    age = current.revision - recorded.revision
    if age > policy.max_gradient_staleness:
        raise StaleGraphError(
            f"checkpoint '{checkpoint_name}': graph is {age} optimizer step(s) old, over max_gradient_staleness="
            f"{policy.max_gradient_staleness}; run backward sooner or raise the bound"
        )
    return age


def importance_weights(logp_current: torch.Tensor, logp_recorded: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """`clamp(exp(logp_current − logp_recorded), low, high)`, with no gradient."""
    with torch.no_grad():
        return torch.exp(logp_current.detach() - logp_recorded.detach()).clamp_(low, high)
