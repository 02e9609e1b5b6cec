"""Where a step's seconds go: functions wrapped in named phases, each charged its own time (exclusive).

    clock = PhaseClock()
    clock.wrap(torch.distributed, "all_gather_object", "coordination")
    clock.wrap(Trainer, "step", "optimizer")   # Trainer.step minus the phases that run inside it
    clock.reset()
    …one step…
    clock.phases(step_s)                       # {"coordination": …, "optimizer": …, "other": the rest}

A wrapped call inside another is charged to its own phase and taken out of
its caller's, so the phases add up to the time spent in wrapped calls; `other`
is what the step spent outside all of them.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any


class PhaseClock:
    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now
        self.seconds: dict[str, float] = {}
        self.enabled = True
        self._inner: list[float] = []
        """Per open wrapped call, the seconds already charged to calls inside it."""

    def reset(self, *, enabled: bool = True) -> None:
        self.seconds = {}
        self.enabled = enabled

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        """Replace `owner.name` (a module's function or a class's method) by a version charged to `phase`."""
        original = getattr(owner, name)
        clock = self

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if not clock.enabled:
                return original(*args, **kwargs)
            clock._inner.append(0.0)
            started = clock.now()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = clock.now() - started
                inner = clock._inner.pop()
                clock.charge(phase, elapsed - inner)
                if clock._inner:
                    clock._inner[-1] += elapsed

        setattr(owner, name, timed)

    def charge(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def phases(self, total_s: float) -> dict[str, float]:
        """The seconds of each phase since `reset`, and `other`: what `total_s` spent outside every phase."""
        return {**self.seconds, "other": total_s - sum(self.seconds.values())}
