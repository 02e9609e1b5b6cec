"""Fault injection for tests of retry and resume, driven by the environment.

`RANKFLOW_FAULT_ONCE=STEP:RANK:MARKER` makes rank RANK fail when it reaches
optimizer step STEP, once: the marker file records that the fault happened,
so the retried launch runs through. Read when called, never at import.
"""

from __future__ import annotations

import os
from pathlib import Path

FAULT_ENV = "RANKFLOW_FAULT_ONCE"


class InjectedFault(RuntimeError):
    """A failure injected on purpose by RANKFLOW_FAULT_ONCE."""


def maybe_inject_fault(step: int, rank: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    fault_step, fault_rank, marker = spec.split(":", 2)
    if step != int(fault_step) or rank != int(fault_rank):
        return
    marker_path = Path(marker)
    if marker_path.exists():
        return
    marker_path.write_text(f"step {step} rank {rank}\n")
    raise InjectedFault(f"injected fault at step {step} on rank {rank} ({FAULT_ENV})")
