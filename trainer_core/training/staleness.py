"""Bounded gradient staleness — the one place that decides how old a graph may be and what that implies.

A graph's age for a checkpoint is `current revision − recorded revision`.
Past `max_gradient_staleness` (default 2; 0 = strict) backward refuses it; a
replaced checkpoint (new identity) is always refused. Within the bound a stale
graph is differentiated at the weights it ran at (`snapshot`), or — with the
`importance` policy — replayed at the current weights with each logprob (and
top-k logprob) cotangent scaled by `clamp(exp(logp_current − logp_recorded),
low, high)`. The estimator does not depend on the backward mode: under
`importance` a retained or offloaded graph also keeps what a replay needs (its
input copies, RNG and module state), and once a step makes it stale it drops
its saved tensors and becomes a replayed graph. No graph holds a weight copy.

The trainer asks this policy every question about age: at backward (`ages`),
before a step (`usable_after_step`: is a weight snapshot worth keeping), after
a step (`expired`: release what can never be differentiated; `is_stale`: a
graph to replay from now on), and per forward (`keeps_weights`: does a graph
need the weights it ran at; `records_stale_replays`: does it need what a
replay at the current weights needs).
"""

from __future__ import annotations

from collections.abc import Mapping
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
        bound = self.max_gradient_staleness
        # bool is an int subclass; True as a bound is a bug, not "1".
        if isinstance(bound, bool) or not isinstance(bound, int):
            raise ValueError(
                f"max_gradient_staleness={bound!r} must be an integer number of optimizer steps (0 = strict)"
            )
        if bound < 0:
            raise ValueError(f"max_gradient_staleness={bound} must be >= 0 (0 = strict)")
        if self.stale_mode not in ("snapshot", "importance"):
            raise ValueError(f"stale_mode={self.stale_mode!r}; choose 'snapshot' or 'importance'")
        if not 0 <= self.importance_low <= self.importance_high:
            raise ValueError(
                f"importance clamp [{self.importance_low}, {self.importance_high}] must satisfy 0 <= low <= high"
            )

    def age(self, checkpoint_name: str, recorded: Version, current: Version) -> int:
        """The graph's age in optimizer steps; raises StaleGraphError past the bound or after a replacement."""
        if recorded.identity != current.identity:
            raise StaleGraphError(
                f"checkpoint '{checkpoint_name}' was replaced since this forward ran (recorded {recorded}, now {current}); "
                "a graph of a replaced checkpoint cannot be differentiated — run the forward again"
            )
        age = current.revision - recorded.revision
        if age > self.max_gradient_staleness:
            raise StaleGraphError(
                f"checkpoint '{checkpoint_name}': graph is {age} optimizer step(s) old, over max_gradient_staleness="
                f"{self.max_gradient_staleness}; run backward sooner or raise the bound"
            )
        return age

    def ages(self, recorded: Mapping[str, Version], current: Mapping[str, Version]) -> dict[str, int]:
        """Age per checkpoint the graph ran at (checkpoints registered after it do not count)."""
        return {name: self.age(name, version, current[name]) for name, version in recorded.items()}

    def expired(self, recorded: Mapping[str, Version], current: Mapping[str, Version]) -> bool:
        """True when the graph can never be differentiated again (replaced, or past the bound)."""
        return any(
            version.identity != current[name].identity
            or current[name].revision - version.revision > self.max_gradient_staleness
            for name, version in recorded.items()
        )

    def usable_after_step(self, recorded: Version, current: Version) -> bool:
        """Whether a graph recorded at `recorded` can still be differentiated once `current` steps once more."""
        return (
            recorded.identity == current.identity
            and current.revision + 1 - recorded.revision <= self.max_gradient_staleness
        )

    def is_stale(self, recorded: Mapping[str, Version], current: Mapping[str, Version]) -> bool:
        """True when some checkpoint the graph ran at has stepped since."""
        return any(current[name].revision != version.revision for name, version in recorded.items())

    def keeps_weights(self) -> bool:
        """Whether a graph holds the weights it ran at, for when it is stale: under `snapshot` it is differentiated
        at them; under `importance` it is replayed at the current weights instead."""
        return self.stale_mode == "snapshot"

    @property
    def records_stale_replays(self) -> bool:
        """Whether a retained or offloaded graph also keeps what a replay needs: under `importance`, where a graph
        can go stale (a bound of 0 expires it at the next step instead)."""
        return self.stale_mode == "importance" and self.max_gradient_staleness > 0

    def replays_at_current_weights(self, age: int) -> bool:
        return age > 0 and self.stale_mode == "importance"


def importance_weights(
    logp_current: torch.Tensor, logp_recorded: torch.Tensor, low: float, high: float
) -> torch.Tensor:
    """`clamp(exp(logp_current − logp_recorded), low, high)`, with no gradient."""
    with torch.no_grad():
        return torch.exp(logp_current.detach() - logp_recorded.detach()).clamp_(low, high)
