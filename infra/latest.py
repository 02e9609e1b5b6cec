"""LATEST: the run's pointer to its newest committed checkpoint, moved only forward.

LATEST is read, compared and replaced with compare-and-swap
(infra/store/conditional.py), so two committers racing on one run can never move
it back: the one whose write lost re-reads and decides again. A LATEST that
cannot be trusted — not JSON, a step that is not a number, or a step whose
checkpoint has no manifest (a hostile far-future step, a deleted checkpoint) —
never blocks a commit: it is replaced, and the outcome says so.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from .store.conditional import create_if_absent, read_versioned, replace_if_unchanged
from .manifests import CHECKPOINTS_DIR, LATEST_FILE, MANIFEST_FILE, checkpoint_name, step_of
from .store.base import ObjectStore, storage_errors

_MAX_RACES = 50


@dataclass(frozen=True)
class LatestPointer:
    checkpoint: str
    step: int


def parse_latest(data: bytes) -> tuple[LatestPointer | None, str | None]:
    """The pointer, or None and what is wrong with it."""
    try:
        raw = json.loads(data)
        step = raw["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            return None, f"step {step!r} is not a non-negative integer"
        name = raw.get("checkpoint", checkpoint_name(step))
        if name != checkpoint_name(step) or step_of(name) is None:
            return None, f"checkpoint {name!r} does not match step {step}"
        return LatestPointer(name, step), None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        return None, f"not a LATEST record ({type(error).__name__}: {error})"


def latest_path(store: ObjectStore, run_id: str) -> str:
    return store.path(run_id, LATEST_FILE)


def read_latest(store: ObjectStore, run_id: str) -> dict | None:
    """LATEST as written (`{"checkpoint", "step"}`), or None when absent or untrustworthy."""
    current = read_versioned(store, latest_path(store, run_id))
    if current is None:
        return None
    pointer, _ = parse_latest(current.data)
    return None if pointer is None else {"checkpoint": pointer.checkpoint, "step": pointer.step}


def manifest_exists(store: ObjectStore, run_id: str, step: int) -> bool:
    with storage_errors(store, f"check of checkpoint {checkpoint_name(step)}"):
        key = store.key(run_id, CHECKPOINTS_DIR, checkpoint_name(step), MANIFEST_FILE)
        return key in store.head([key])


def newest_committed_step(store: ObjectStore, run_id: str) -> int | None:
    """The highest step whose checkpoint has a manifest (None if none has)."""
    with storage_errors(store, f"listing of the checkpoints of run {run_id}"):
        names = store.children(store.key(run_id, CHECKPOINTS_DIR))
    if not names:
        return None
    for step in sorted((s for s in map(step_of, names) if s is not None), reverse=True):
        if manifest_exists(store, run_id, step):
            return step
    return None


@dataclass(frozen=True)
class LatestMove:
    moved: bool
    step: int
    """Where LATEST points after the call."""
    note: str | None = None
    """What was wrong with the LATEST that was replaced, if anything."""


def advance_latest(store: ObjectStore, run_id: str, step: int,
                   on_read: Callable[[], None] | None = None) -> LatestMove:
    """Point LATEST at `step` unless it already points at a committed checkpoint at or past it.

    `on_read` runs between reading and writing (tests pause there to race two committers).
    """
    path = latest_path(store, run_id)
    for _ in range(_MAX_RACES):
        current = read_versioned(store, path)
        note, target = None, step
        if current is not None:
            pointer, problem = parse_latest(current.data)
            if pointer is not None and pointer.step >= step:
                if pointer.step == step or manifest_exists(store, run_id, pointer.step):
                    return LatestMove(moved=False, step=pointer.step)
                problem = f"it points at {pointer.checkpoint}, which has no manifest"
            if problem is not None:
                # Repairing must not move LATEST behind a newer checkpoint that exists.
                target = max(step, newest_committed_step(store, run_id) or 0)
                note = f"LATEST was not trustworthy ({problem}); replaced with {checkpoint_name(target)}"
        record = json.dumps({"checkpoint": checkpoint_name(target), "step": target}).encode()
        if on_read is not None:
            on_read()
        if current is None:
            won = create_if_absent(store, path, record) is not None
        else:
            won = replace_if_unchanged(store, path, record, current.tag) is not None
        if won:
            return LatestMove(moved=True, step=target, note=note)
        # Another committer wrote LATEST between our read and our write: decide again.
    raise RuntimeError(f"LATEST of run {run_id} changed {_MAX_RACES} times while step {step} tried to move it; "
                       "more committers are racing than the finalizer lease should allow — check for a second "
                       "writer without a lease, then retry")
