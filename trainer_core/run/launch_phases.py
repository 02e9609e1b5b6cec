"""Where a rank's start-up seconds go: wall-clock marks of its set-up phases, for the segment's `ready` record.

    phases = LaunchPhases.starting()   # the process's own start (from the kernel) and now (imports done)
    phases.mark("process_group")       # after each named phase
    progress.write("ready", phases=phases.marks, ...)

The marks are epoch seconds (`time.time()`), so they line up with the
launcher's clock and the progress records' `time`: `python -m bench.launch`
reads them to split a launch into torchrun agent, interpreter and imports,
process group, model build, state load, shard, first step. The process's
start comes from `/proc/self/stat` (in clock ticks after boot), so it covers
the interpreter's own start-up too; elsewhere it is absent.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

FORKED_ENV = "RANKFLOW_WARM_FORKED"
"""Set to 1 in a rank forked by a run's warm process (`trainer_core.run.warm_zygote`)."""


def process_start_time() -> float | None:
    """When this process started, in epoch seconds (resolution: one clock tick, 10 ms); None off Linux.

    The kernel gives the start in clock ticks after boot; its age (now after boot, from /proc/uptime, less that)
    is taken from `time.time()`. Added to /proc/stat's `btime` instead, it was up to a second early: btime is
    whole seconds, and the wall clock drifts from the boot clock (a forked rank seemed to spend 0.94 s between
    its fork and its first line).
    """
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    now = time.time()
    # Field 22 (starttime); the command name (field 2) may hold spaces, so count after its closing parenthesis.
    start_ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
    return now - max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))


@dataclass
class LaunchPhases:
    """Named epoch-second marks, in the order they happened."""

    marks: dict[str, float] = field(default_factory=dict)

    @classmethod
    def starting(cls) -> LaunchPhases:
        """Marks `process_start` (when known) and `imports_done` (now: the rank's code is loaded); a rank the
        run's warm process forked (its imports done before it started) also marks `forked`, at its start."""
        phases = cls()
        started = process_start_time()
        if started is not None:
            phases.marks["process_start"] = started
            if os.environ.get(FORKED_ENV) == "1":
                phases.marks["forked"] = started
        phases.mark("imports_done")
        return phases

    def mark(self, phase: str) -> None:
        self.marks[phase] = time.time()
