"""Fault injection for tests of retry and resume, driven by the environment.

`RANKFLOW_FAULT_ONCE=STEP:RANK:MARKER` makes rank RANK fail when it reaches
optimizer step STEP, once: the marker file records that the fault happened,
so the retried launch runs through. `RANKFLOW_EXPORT_FAULT_ONCE=RANK:MARKER`
does the same to the export stage, once its rank has loaded the state.
`RANKFLOW_NONFINITE_LOSS=STEP:RANK` makes rank RANK's loss NaN at optimizer
step STEP, every time (to test the `train.nonfinite` policy).
Read when called, never at import.
"""

from __future__ import annotations

import os
from pathlib import Path

FAULT_ENV = "RANKFLOW_FAULT_ONCE"
EXPORT_FAULT_ENV = "RANKFLOW_EXPORT_FAULT_ONCE"
NONFINITE_LOSS_ENV = "RANKFLOW_NONFINITE_LOSS"


class InjectedFault(RuntimeError):
    """A failure injected on purpose by RANKFLOW_FAULT_ONCE."""


def maybe_inject_fault(step: int, rank: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    fault_step, fault_rank, marker = spec.split(":", 2)
    if step == int(fault_step):
        _fail_once(rank, int(fault_rank), Path(marker), f"step {step}", FAULT_ENV)


def maybe_inject_export_fault(rank: int) -> None:
    spec = os.environ.get(EXPORT_FAULT_ENV)
    if spec:
        fault_rank, marker = spec.split(":", 1)
        _fail_once(rank, int(fault_rank), Path(marker), "export", EXPORT_FAULT_ENV)


def nonfinite_loss_factor(step: int, rank: int) -> float:
    """NaN where RANKFLOW_NONFINITE_LOSS asks for a non-finite loss, else 1."""
    spec = os.environ.get(NONFINITE_LOSS_ENV)
    if not spec:
        return 1.0
    fault_step, fault_rank = (int(part) for part in spec.split(":", 1))
    return float("nan") if (step, rank) == (fault_step, fault_rank) else 1.0


def _fail_once(rank: int, fault_rank: int, marker: Path, where: str, variable: str) -> None:
    if rank != fault_rank or marker.exists():
        return
    marker.write_text(f"{where} rank {rank}\n")
    raise InjectedFault(f"injected fault at {where} on rank {rank} ({variable})")
