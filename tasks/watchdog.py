"""The progress watchdog of a segment or an export launch: no progress for `train.stall_timeout_s` ends it.

It tails the progress file rank 0 writes (`trainer_core.run.progress`): `ready`
when setup is done; for a segment one `step` record per optimizer step,
`saving` and `saved` around the state save; for an export one `phase` record
as each preparation phase begins, `exported` at the end. Each record resets
the clock, which starts when the launch starts. Every step, every export
phase and the state save must finish within `stall_timeout_s`; setup
(process start, imports, rendezvous, building the model, restoring the
state) gets `max(stall_timeout_s, SETUP_GRACE_S)`, since on a busy machine
starting the ranks alone can outlast a short step budget.
A rank that is stopped, hung, or blocked in a collective on a dead peer stops
the records, and the launch is ended after `stall_timeout_s` plus a few
seconds, not after the collective timeout.

The watch is the launcher's `monitor`: called every half second in the
task's thread, it hands new records to the live view and returns the reason
to stop when the launch has stalled.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from trainer_core.run.progress import ProgressReader

SETUP_GRACE_S = 120.0
"""The least time setup gets before the first record, whatever stall_timeout_s is."""


class ProgressWatch:
    def __init__(
        self,
        progress_file: Path,
        stall_timeout_s: float,
        on_records: Callable[[list[dict]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # Made just before its launch: a failed attempt's file is not this launch's progress. Read, its old records
        # would count as progress, and once the new rank 0 truncated the file and wrote past the old length the
        # reader would resume mid-record.
        progress_file.unlink(missing_ok=True)
        self._reader = ProgressReader(progress_file)
        self._stall_timeout_s = stall_timeout_s
        self._on_records = on_records
        self._clock = clock
        self._last_progress = clock()
        self.last_record: dict | None = None
        self.records: list[dict] = []

    def __call__(self) -> str | None:
        records = self._reader.new_records()
        if records:
            self._last_progress = self._clock()
            self.last_record = records[-1]
            self.records.extend(records)
        if self._on_records is not None:
            self._on_records(records)  # also when empty: the live view flushes what it held back
        silent_s = self._clock() - self._last_progress
        limit_s = self._stall_timeout_s if self.last_record else max(self._stall_timeout_s, SETUP_GRACE_S)
        if silent_s <= limit_s:
            return None
        return f"no progress for {silent_s:.0f} s (train.stall_timeout_s={self._stall_timeout_s:g}); {self._where()}"

    def _where(self) -> str:
        last = self.last_record
        if last is None:
            return "setup never finished"
        if last["event"] == "step":
            return f"last completed step {last['step']}"
        if last["event"] == "phase":
            return f"stuck in the export phase '{last['phase']}'"
        return f"last event: {last['event']}"

    @property
    def steps(self) -> list[dict]:
        return [r for r in self.records if r["event"] == "step"]


SegmentWatch = ProgressWatch
"""The name segments (and their tests) know it by."""
