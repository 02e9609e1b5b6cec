"""The memory planner: per graph, retain, offload or replay, from a budget and measured costs.

With no budget every graph is retained. With a budget of resident saved-tensor
bytes, a graph is retained while the estimate fits; past it the planner picks
whichever of offload (moving its bytes out and back) and replay (one more
forward) has the lower measured cost. Costs are running averages of what the
trainer observed, so the choice adapts to the machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import BackwardMode


def _ema(old: float | None, new: float, weight: float = 0.3) -> float:
    return new if old is None else (1 - weight) * old + weight * new


@dataclass
class MemoryPlanner:
    budget_bytes: int | None = None
    """Resident saved-tensor bytes allowed over all live graphs (None: no limit)."""
    retained_bytes_per_token: float | None = None
    offload_bytes_per_s: float | None = None
    forward_s_per_token: float | None = None

    def choose(self, num_tokens: int, resident_bytes: int) -> BackwardMode:
        if self.budget_bytes is None:
            return "retain"
        if self.retained_bytes_per_token is None:
            # Nothing measured yet: retain once (that measures it) if anything fits.
            return "retain" if resident_bytes < self.budget_bytes else "replay"
        estimate = self.retained_bytes_per_token * num_tokens
        if resident_bytes + estimate <= self.budget_bytes:
            return "retain"
        offload_s = 2 * estimate / self.offload_bytes_per_s if self.offload_bytes_per_s else math.inf
        replay_s = self.forward_s_per_token * num_tokens if self.forward_s_per_token else math.inf
        if math.isinf(offload_s) and math.isinf(replay_s):
            return "replay"  # replay keeps the least, and its cost is measured on first use
        return "offload" if offload_s < replay_s else "replay"

    def observe_retained(self, saved_bytes: int, num_tokens: int) -> None:
        if num_tokens:
            self.retained_bytes_per_token = _ema(self.retained_bytes_per_token, saved_bytes / num_tokens)

    def observe_offload(self, num_bytes: int, seconds: float) -> None:
        if num_bytes and seconds > 0:
            self.offload_bytes_per_s = _ema(self.offload_bytes_per_s, num_bytes / seconds)

    def observe_forward(self, seconds: float, num_tokens: int) -> None:
        if num_tokens:
            self.forward_s_per_token = _ema(self.forward_s_per_token, seconds / num_tokens)
