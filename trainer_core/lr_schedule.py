"""Learning-rate schedules: a multiplier of the base rate per optimizer step, the forms transformers' schedulers take.

A schedule is stateless: the rate of step `s` (0-based) is `base * multiplier(s)`, so a run resumed at any step, at
any world size, needs nothing saved to continue it. The forms are those of `transformers.optimization`, which users
of the field train with (the HF Trainer, TRL, axolotl), step for step: a linear warm-up from 0 (step `s < warmup`
gets `s / warmup`, so step 0 updates the moments at rate 0, as there), then

- `constant`: 1 (`get_constant_schedule_with_warmup`);
- `linear`: down to `min_lr_ratio` at `total_steps` (`get_linear_schedule_with_warmup` at ratio 0,
  `get_polynomial_decay_schedule_with_warmup` with power 1 above it);
- `cosine`: half a cosine down to `min_lr_ratio` (`get_cosine_schedule_with_warmup` at ratio 0,
  `get_cosine_with_min_lr_schedule_with_warmup` above it).

tests/trainer/test_lr_schedule.py holds every form to those schedulers, stepped with a real optimizer, to 1e-12.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

ScheduleKind = Literal["constant", "linear", "cosine"]
SCHEDULE_KINDS: tuple[ScheduleKind, ...] = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    kind: ScheduleKind = "constant"
    warmup_steps: int = 0
    total_steps: int = 1
    """The step the decay ends at (the run's `train.steps`); past it the multiplier stays at `min_lr_ratio`."""
    min_lr_ratio: float = 0.0
    """The multiplier the decay ends at (linear, cosine)."""

    def __post_init__(self):
        if self.kind not in SCHEDULE_KINDS:
            raise ValueError(f"LRSchedule.kind must be one of {SCHEDULE_KINDS} (got {self.kind!r})")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError(
                f"LRSchedule needs warmup_steps >= 0 and total_steps >= 1 (got {self.warmup_steps}, {self.total_steps})"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"LRSchedule.min_lr_ratio must be in [0, 1] (got {self.min_lr_ratio})")
        if self.kind == "constant" and self.min_lr_ratio != 0.0:
            raise ValueError("LRSchedule.min_lr_ratio is the end of a decay: use kind 'linear' or 'cosine'")

    def multiplier(self, step: int) -> float:
        """The factor of the base learning rate at optimizer step `step` (0-based)."""
        if step < 0:
            raise ValueError(f"a schedule step is 0 or more (got {step})")
        if step < self.warmup_steps:
            return float(step) / float(max(1, self.warmup_steps))
        if self.kind == "constant":
            return 1.0
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, float(step - self.warmup_steps) / float(decay_steps))
        if self.kind == "linear":
            remaining = 1.0 - progress
        else:
            remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
        return remaining * (1.0 - self.min_lr_ratio) + self.min_lr_ratio
