"""Lower the calling thread's CPU priority: work that runs beside training yields the cores to the ranks.

The state upload hashes the state beside the next segment (about a core at
1.2 GB/s per file). At the same priority it takes that core from the next
segment's ranks while they load the state and take their first step, the
boundary's critical path. Linux keeps a nice value per thread, so a short-
lived worker thread (a hashing pool's) can lower its own and end with it;
an unprivileged thread could never raise it back, so a long-lived one must
not call this. Elsewhere (no per-thread priority, or not permitted) nothing
changes.
"""

from __future__ import annotations

import os
import threading

YIELDING_NICE = 10
"""Added to the thread's nice value: under load it gets about a tenth of a core's share of a nice-0 thread."""


def yield_cpu() -> None:
    """Raise this thread's nice value by YIELDING_NICE (at most 19)."""
    try:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + YIELDING_NICE))
    except (AttributeError, OSError):
        pass
