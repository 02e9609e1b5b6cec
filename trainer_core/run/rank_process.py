"""Hygiene of a rank process: die with torchrun, dump stacks on request, write whole lines, record errors.

torchrun starts each rank in a session of its own, so a signal to torchrun's
process group never reaches the ranks, and a torchrun that is killed outright
(SIGKILL: its parent died, or the orchestrator gave up on a stalled launch)
would leave them running. Each rank therefore asks the kernel to SIGKILL it
when torchrun dies (`PR_SET_PDEATHSIG`), which also ends a rank that is
stopped (SIGSTOP) or blocked in a collective: armed before its first import
by `trainer_core.run.process_boot`, which the launcher starts every rank with,
and again (against the same parent) by `run_rank_main`.

A rank's lines are written with one `write` each: `print` writes the text and
the newline separately, and two ranks sharing a pipe could interleave them.
A line past the pipe's atomic size is cut into prefixed pieces.

A rank that has finished leaves with `leave_now`: its work is on disk and
its process group is gone, and Python's own teardown of torch, transformers
and friends (freeing every module, running their exit hooks) took 0.5-5 s of
every launch, while torchrun and the next segment waited.

An error is recorded as JSON (`rank-R.error.json` in `RANKFLOW_RANK_ERRORS_DIR`,
set by the launcher) with its time, so the orchestrator can name the first
failing rank even when the others fail a moment later because of it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

ERRORS_DIR_ENV = "RANKFLOW_RANK_ERRORS_DIR"
_ATOMIC_LINE_BYTES = 4000  # below PIPE_BUF (4096): one write(2) of this size is never interleaved


def dump_stacks_on(sig: int = signal.SIGUSR1) -> None:
    """Print every thread's Python stack on `sig`: the watchdog asks a stalled launch where it is."""
    faulthandler.register(sig, file=sys.stderr, all_threads=True)


def write_line(text: str, fd: int = 1) -> None:
    """Write `text` and its newline with one write(2) per piece of at most ~4000 bytes."""
    data = text.encode("utf-8", "replace")
    if len(data) < _ATOMIC_LINE_BYTES:
        os.write(fd, data + b"\n")
        return
    for start in range(0, len(data), _ATOMIC_LINE_BYTES):
        os.write(fd, data[start : start + _ATOMIC_LINE_BYTES] + b"\n")


class RankErrorRecord(BaseModel):
    """`rank-R.error.json`: the error a rank failed with, and when (the launcher orders ranks by `time`)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    rank: int = Field(ge=0)
    time: Annotated[float, Field(allow_inf_nan=False)]
    type: str
    """The exception's class name."""
    message: str
    traceback: str = ""
    """The formatted traceback's last 8000 characters."""

    def to_json(self) -> str:
        # The bytes of every record written before this model (field order, default separators).
        return json.dumps(self.model_dump())

    @classmethod
    def read(cls, path: Path) -> RankErrorRecord:
        """The record at `path`; ValueError if it is not one (a rank killed while writing it)."""
        return cls.model_validate(json.loads(path.read_text()))


def leave_now(code: int = 0) -> None:
    """Flush stdout and stderr and end the process at once with `code`, skipping the interpreter's teardown.

    Only for a process whose work is done and durable: files it wrote are closed (atomic renames, `os.write`
    records), so nothing is left for the exit hooks but freeing memory the kernel frees anyway.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said anyway
            pass
    os._exit(code)


def record_error(rank: int, error: BaseException) -> None:
    """Write the error with its time for the launcher (when it asked for it)."""
    directory = os.environ.get(ERRORS_DIR_ENV)
    if not directory:
        return
    record = RankErrorRecord(
        rank=rank,
        time=time.time(),
        type=type(error).__name__,
        message=str(error),
        traceback="".join(traceback.format_exception(error))[-8000:],
    )
    path = error_path(Path(directory), rank)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(record.to_json())
    os.replace(tmp, path)


def error_path(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank}.error.json"
