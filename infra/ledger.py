"""The run ledger: one JSON line per stage outcome, stored with the run.

Appended locally with fsync as each stage ends (so a crash keeps what was
recorded) and uploaded next to the run's checkpoints at the end of the flow,
merged with the ledger already stored there (`merge`): the work dir is a
cache, so a flow on a fresh worker adds to the run's history instead of
replacing it.
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
    with (run_dir / LEDGER_FILE).open("a") as handle:
        handle.write(json.dumps(entry, sort_keys=True) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    return entry


def read(run_dir: Path) -> list[dict]:
    path = run_dir / LEDGER_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def merge(stored: bytes, local: bytes) -> bytes:
    """The union of two ledgers' entries, each once, in time order (a stored ledger and this worker's)."""
    lines = {line for data in (stored, local) for line in data.decode().splitlines() if line.strip()}

    def when(line: str) -> tuple[float, str]:
        try:
            return float(json.loads(line)["time"]), line
        except (ValueError, KeyError, TypeError):
            return float("-inf"), line  # an unreadable line is kept, first, for a person to look at

    return "".join(line + "\n" for line in sorted(lines, key=when)).encode()
