"""Live progress of a segment or an export: rank 0 appends one JSON line per event to a small file.

    RUN_DIR/progress/segment-NNNN.jsonl
    RUN_DIR/progress/export-NNNN.jsonl

Segment events: `ready` (setup done: the process group is up, the model built
and the state restored; its `phases` give when each set-up phase ended,
`trainer_core.run.launch_phases`), `step` (one optimizer step finished, with its
figures) and `saved` (the segment's state is saved). Export events: `ready`
(the state is loaded on every rank), `phase` (a preparation phase begins:
`phase` names it) and `exported` (the staging is in place). The orchestrator tails the file while
torchrun runs: it shows the figures live and its watchdog treats every event
as a sign of progress. Each record is written with one `os.write` on a file
opened with O_APPEND, so a reader never sees half a record followed by another.
No Prefect here: this is a plain file protocol.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from trainer_core.run.layout import RunDir


def progress_path(run_dir: Path, segment_index: int) -> Path:
    return RunDir(run_dir).progress_file(segment_index)


def export_progress_path(run_dir: Path, segment_index: int) -> Path:
    """The progress of the export of segment `segment_index`'s state."""
    return RunDir(run_dir).export_progress_file(segment_index)


class ProgressWriter:
    """Appends progress records; a no-op on every rank but rank 0."""

    def __init__(self, path: Path, *, rank: int, fresh: bool = True) -> None:
        self._fd: int | None = None
        if rank != 0:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if fresh else 0)
        self._fd = os.open(path, flags, 0o644)

    def write(self, event: str, **figures) -> None:
        if self._fd is None:
            return
        record = {"event": event, "time": time.time(), **figures}
        os.write(self._fd, (json.dumps(record, allow_nan=True) + "\n").encode())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class ProgressReader:
    """Reads the records appended since the last call; tolerates a file not created yet."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def new_records(self) -> list[dict]:
        try:
            with self.path.open("rb") as handle:
                if self.path.stat().st_size < self._offset:  # truncated: a new writer started over
                    self._offset, self._partial = 0, b""
                handle.seek(self._offset)
                chunk = handle.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()  # an unfinished last line waits for the next call
        return [json.loads(line) for line in lines if line.strip()]
