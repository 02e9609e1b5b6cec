"""The run ledger: one JSON line per stage outcome, stored with the run.

Appended locally with fsync as each stage ends (so a crash keeps what was
recorded) and uploaded next to the run's checkpoints at the end of the flow.
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
