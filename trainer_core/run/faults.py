"""Fault injection for tests of retry, resume and time-to-fail, driven by the environment.

`RANKFLOW_FAULT_ONCE=STEP:RANK:MARKER` makes rank RANK fail when it reaches
optimizer step STEP, once: the marker file records that the fault happened,
so the retried launch runs through. `RANKFLOW_EXPORT_FAULT_ONCE=RANK:MARKER`
does the same to the export stage, once its rank has loaded the state.
`RANKFLOW_UPLOAD_FAULT_ONCE=SEGMENT:MARKER` makes the process uploading
segment SEGMENT's state fail once its first data file is stored (before the
bundle's manifest: an upload in flight).
`RANKFLOW_NONFINITE_LOSS=STEP:RANK` makes rank RANK's loss NaN at optimizer
step STEP, every time (to test the `train.nonfinite` policy).
`RANKFLOW_COMMAND_FAULT=COMMAND:RANK` makes rank RANK raise InjectedFault at
the start of every facade command named COMMAND (`forward`, `backward`,
`step`, `save`, `load`, `export`, `call`, `logical_rank`, or a name given to
`LogicalDataParallel.command`), every time (to test coordinated failure).

`RANKFLOW_FAULT_KIND` says how the rank fails (default `raise`):

| kind   | what the rank does                          | failure class it stands for     |
|--------|---------------------------------------------|---------------------------------|
| raise  | raises InjectedFault (a transient error)    | retried                         |
| code   | raises TypeError (a bug)                    | code error, not retried         |
| data   | raises DataError (bad input)                | bad input, not retried          |
| kill   | SIGKILLs itself (as the OOM killer would)   | dead rank, retried              |
| term   | SIGTERMs itself (as a preemption would)     | preemption, retried             |
| stop   | SIGSTOPs itself, mid-step                   | hang: the watchdog fires        |
| hang   | sleeps forever inside the step              | collective timeout on its peers |

Read when called, never at import.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

FAULT_ENV = "RANKFLOW_FAULT_ONCE"
EXPORT_FAULT_ENV = "RANKFLOW_EXPORT_FAULT_ONCE"
NONFINITE_LOSS_ENV = "RANKFLOW_NONFINITE_LOSS"
FAULT_KIND_ENV = "RANKFLOW_FAULT_KIND"
COMMAND_FAULT_ENV = "RANKFLOW_COMMAND_FAULT"
UPLOAD_FAULT_ENV = "RANKFLOW_UPLOAD_FAULT_ONCE"
FAULT_KINDS = ("raise", "code", "data", "kill", "term", "stop", "hang")


class InjectedFault(RuntimeError):
    """A transient failure injected on purpose by RANKFLOW_FAULT_ONCE."""


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


def upload_fault(segment_index: int) -> Callable[[str], None] | None:
    """An upload observer that fails the uploading process at its first stored file, once (None: no fault asked)."""
    spec = os.environ.get(UPLOAD_FAULT_ENV)
    if not spec:
        return None
    fault_segment, marker = spec.split(":", 1)
    if int(fault_segment) != segment_index:
        return None

    def observe(event: str) -> None:
        if event.startswith("uploaded "):
            _fail_once(0, 0, Path(marker), f"upload of segment {segment_index}", UPLOAD_FAULT_ENV)

    return observe


def maybe_inject_command_fault(command: str, rank: int) -> None:
    spec = os.environ.get(COMMAND_FAULT_ENV)
    if not spec:
        return
    fault_command, fault_rank = spec.rsplit(":", 1)
    if command == fault_command and rank == int(fault_rank):
        raise InjectedFault(f"injected fault in {command} on rank {rank} ({COMMAND_FAULT_ENV})")


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
    kind = os.environ.get(FAULT_KIND_ENV, "raise")
    if kind not in FAULT_KINDS:
        raise ValueError(f"{FAULT_KIND_ENV}={kind!r}: choose one of {', '.join(FAULT_KINDS)}")
    marker.write_text(f"{kind} at {where} rank {rank}\n")  # before the fault: a killed rank writes nothing after
    message = f"injected fault at {where} on rank {rank} ({variable})"
    if kind == "raise":
        raise InjectedFault(message)
    if kind == "code":
        raise TypeError(f"{message}: a code error")
    if kind == "data":
        from trainer_core.data import DataError

        raise DataError(f"{message}: bad data")
    if kind in ("kill", "term", "stop"):
        os.kill(os.getpid(), {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}[kind])
        return  # after SIGCONT (stop), carry on
    while True:  # hang: never reach the step's collectives
        time.sleep(3600)
