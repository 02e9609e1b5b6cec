"""Segment K's state upload waits until segment K+1 has loaded K's state (its first optimizer step).

The upload reads every byte of the state (its digests, then the transfer),
and its store client runs on the flow process's one fsspec event loop, which
the next segment's input check also uses. Started beside the next launch,
it competes with that launch for the disk it loads the state from, for the
CPU its ranks start on, and for the event loop: on this project's CI
machines the input check took 0.9 s beside an upload against 0.4 s without,
and at real size (a 100 GB state on a node's NVMe) the upload's reads would
take half the disk's rate from the next segment's load. Held until K+1's
first step, the upload still runs beside K+1's training, which is all that
hiding it needs.

The flow holds K's upload as it submits it, when a segment K+1 follows on
this node (`StateUploads.after`); K+1's task releases it at its first
`step` record (written after the step, and after its evaluation where one
is due), or when the task ends however it ends; the flow releases
every hold before it waits for the uploads (a checkpoint to publish, the
report) and when it leaves. A hold not released within `HOLD_LIMIT_S` lapses
and the upload starts anyway: a lost release costs time, never the upload.
Holds live in the flow's process, whose threads run its tasks.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

HOLD_LIMIT_S = 600.0
"""The longest an upload waits for the next segment's first step (a very large model's load may take minutes)."""

_holds: dict[tuple[str, int], threading.Event] = {}
_lock = threading.Lock()


def _key(run_dir: Path | str, segment_index: int) -> tuple[str, int]:
    return str(Path(run_dir).resolve()), segment_index


def hold(run_dir: Path | str, segment_index: int) -> None:
    """Segment `segment_index`'s upload waits (`wait_for_release`) until `release` for it."""
    with _lock:
        _holds.setdefault(_key(run_dir, segment_index), threading.Event())  # a waiter on a hold keeps waiting on it


def release(run_dir: Path | str, segment_index: int) -> None:
    """Let segment `segment_index`'s upload start (nothing where it is not held)."""
    with _lock:
        held = _holds.pop(_key(run_dir, segment_index), None)
    if held is not None:
        held.set()


def release_all(run_dir: Path | str) -> None:
    """Let every held upload of the run start."""
    run = str(Path(run_dir).resolve())
    with _lock:
        held = [_holds.pop(key) for key in [key for key in _holds if key[0] == run]]
    for event in held:
        event.set()


def wait_for_release(run_dir: Path | str, segment_index: int, limit_s: float = HOLD_LIMIT_S) -> float:
    """Block while segment `segment_index`'s upload is held, at most `limit_s`; returns the seconds waited."""
    with _lock:
        held = _holds.get(_key(run_dir, segment_index))
    if held is None:
        return 0.0
    started = time.monotonic()
    if not held.wait(limit_s):  # lapsed: the next segment never said; the upload goes on without it
        with _lock:
            if _holds.get(_key(run_dir, segment_index)) is held:  # not a newer hold under the same key
                del _holds[_key(run_dir, segment_index)]
        held.set()
    return time.monotonic() - started


class ReleaseAtFirstStep:
    """A progress-record consumer for segment K+1's watch: releases K's upload at K+1's first `step` record."""

    def __init__(self, run_dir: Path | str, held_segment: int) -> None:
        self.run_dir, self.held_segment = run_dir, held_segment

    def __call__(self, records: list[dict]) -> None:
        if any(record.get("event") == "step" for record in records):
            release(self.run_dir, self.held_segment)
