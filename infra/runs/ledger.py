"""The run ledger: one JSON line per stage outcome, stored with the run.

Appended locally with fsync as each stage ends (so a crash keeps what was
recorded) and uploaded next to the run's checkpoints at the end of the flow,
merged with the ledger already stored there (`merge`): the work dir is a
cache, so a flow on a fresh worker adds to the run's history instead of
replacing it.

A line is written whole or not at all: an append that fails (a full disk
gives a short write, then ENOSPC) is cut back to where it started, and the
error it raised is the one the caller sees. A line torn some other way (a
kill mid-write) is skipped by `read`, and the next append starts a line of
its own, so one bad line never hides the others.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

LEDGER_FILE = "ledger.jsonl"


def record(run_dir: Path, stage: str, status: str, **figures) -> dict:
    entry = {"time": time.time(), "stage": stage, "status": status, **figures}
    run_dir.mkdir(parents=True, exist_ok=True)
    _append_whole(run_dir / LEDGER_FILE, (json.dumps(entry, sort_keys=True) + "\n").encode())
    return entry


def _append_whole(path: Path, line: bytes) -> None:
    """Append `line` and fsync it, or leave the file exactly as it was and raise."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line  # the last line was torn: do not glue this one to it
        written = 0
        try:
            while written < len(line):
                written += os.write(fd, line[written:])
            os.fsync(fd)
        except BaseException:
            os.ftruncate(fd, size)  # never leave part of a line (shrinking needs no free space)
            raise
    finally:
        os.close(fd)


def _entry(line: str) -> dict | None:
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) else None


def read(run_dir: Path) -> list[dict]:
    """The ledger's entries in the order written; a line that is not a whole JSON object is skipped."""
    path = run_dir / LEDGER_FILE
    if not path.is_file():
        return []
    entries = (_entry(line) for line in path.read_text(errors="replace").splitlines() if line.strip())
    return [entry for entry in entries if entry is not None]


def merge(stored: bytes, local: bytes) -> bytes:
    """The union of two ledgers' entries, each once, in time order (a stored ledger and this worker's)."""
    lines = {line for data in (stored, local) for line in data.decode(errors="replace").splitlines() if line.strip()}

    def when(line: str) -> tuple[float, str]:
        try:
            return float(json.loads(line)["time"]), line
        except (ValueError, KeyError, TypeError):
            return float("-inf"), line  # an unreadable line is kept, first, for a person to look at

    return "".join(line + "\n" for line in sorted(lines, key=when)).encode()
