"""Start a Python module in a process that dies with its parent, armed before any slow import.

    python PATH/TO/trainer_core/run/process_boot.py MODULE [ARGS...]    (as `python -m MODULE ARGS...`)

A launch is a chain: the orchestrator starts torchrun, torchrun starts the
ranks, each in a session of its own, so only the kernel's parent-death
signal (`PR_SET_PDEATHSIG`) ties them together when the orchestrator is
SIGKILLed. The signal must be armed before the process does anything slow:
`python -m trainer_core.run.segment_main` imports trainer_core's package first
(torch, transformers: seconds, much longer on a busy machine), and a parent
that dies in that window leaves a child re-parented to init that, arming
afterwards, would follow init for good. So each process of a launch is
started through this file, run by its path (a module under a package would
import the package first), which imports only the standard library, arms
the signal against the parent its parent named (`RANKFLOW_PARENT_PID`), exits
at once if that parent is already gone, and only then runs MODULE as
`__main__`, as `-m` would; or, when the launcher named a run's warm process,
has that process fork MODULE with its imports done and stands in for it
(`trainer_core.run.warm_client`).

Linux only; elsewhere MODULE just runs.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1
PARENT_PID_ENV = "RANKFLOW_PARENT_PID"
"""The pid this process must die with, set by whoever starts it (the launcher for torchrun, torchrun for its ranks)."""
BOOT_SCRIPT = Path(__file__).resolve()
"""This file, for launchers to run: `python BOOT_SCRIPT MODULE ARGS...`."""


def expected_parent() -> int | None:
    """The parent named by RANKFLOW_PARENT_PID, or None when nobody named one."""
    value = os.environ.get(PARENT_PID_ENV, "")
    return int(value) if value.isdigit() else None


def die_with_parent(expected: int | None = None) -> None:
    """SIGKILL this process when its parent exits; exit now if it already has.

    `expected` (default: RANKFLOW_PARENT_PID) closes the window between fork
    and this call: a parent that died in it has left this process with
    another parent, so it exits instead of following that one. Without
    either, the parent seen now is taken as the one to follow.
    """
    if not sys.platform.startswith("linux"):
        return
    expected = expected if expected is not None else expected_parent()
    parent = os.getppid() if expected is None else expected
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _run_module_as_main(argv: list[str]) -> None:
    import runpy

    module, *args = argv
    # As `python -m` would have it: the current directory first on the path, not this file's.
    sys.path[0] = os.getcwd()
    sys.argv = [module, *args]  # runpy puts the module's file in argv[0]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(f"usage: python {BOOT_SCRIPT} MODULE [ARGS...]")
    die_with_parent()
    if sys.argv[1] in os.environ.get("RANKFLOW_WARM_MODULES", "").split(","):  # forked with its imports done
        from trainer_core.run.warm_client import run_warm

        run_warm(sys.argv[1], sys.argv[2:])  # returns only when it cannot serve this module
    _run_module_as_main(sys.argv[1:])
