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
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from infra.publication.manifests import (
    MANIFEST_FILE,
    checkpoint_key,
    checkpoint_name,
    checkpoints_dir_key,
    latest_key,
    step_of,
)
from infra.store.base import ObjectStore
from infra.store.conditional import create_if_absent, read_versioned, replace_if_unchanged

_MAX_RACES = 50


class LatestPointer(BaseModel):
    """LATEST's content: a step and its checkpoint's name (derived from the step when absent; must match it)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    checkpoint: str
    step: int = Field(ge=0)

    @model_validator(mode="before")
    @classmethod
    def _name_from_step(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and "checkpoint" not in raw and type(raw.get("step")) is int:
            return {**raw, "checkpoint": checkpoint_name(raw["step"])}
        return raw

    @model_validator(mode="after")
    def _name_matches_step(self) -> LatestPointer:
        if self.checkpoint != checkpoint_name(self.step):
            raise ValueError(f"checkpoint {self.checkpoint!r} does not match step {self.step}")
        return self

    @classmethod
    def at(cls, step: int) -> LatestPointer:
        return cls(checkpoint=checkpoint_name(step), step=step)

    def to_bytes(self) -> bytes:
        # The bytes of every LATEST written before this model: checkpoint then step, default separators.
        return json.dumps(self.model_dump()).encode()


def parse_latest(data: bytes) -> tuple[LatestPointer | None, str | None]:
    """The pointer, or None and what is wrong with it."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as error:
        return None, f"not a LATEST record ({type(error).__name__}: {error})"
    try:
        return LatestPointer.model_validate(raw), None
    except ValidationError as error:
        return None, _problem(error)


def _problem(error: ValidationError) -> str:
    """What is wrong with a LATEST record, worded as its readers always have."""
    problems = error.errors()
    first = next((p for p in problems if tuple(p["loc"]) == ("step",)), problems[0])  # the step first, as before
    if first["type"] == "value_error":
        return str(first.get("ctx", {}).get("error"))
    if tuple(first["loc"]) == ("step",) and first["type"] != "missing":
        return f"step {first['input']!r} is not a non-negative integer"
    where = ".".join(map(str, first["loc"]))
    return f"not a LATEST record ({where + ': ' if where else ''}{first['msg']})"


def latest_path(store: ObjectStore, run_id: str) -> str:
    return store.path(latest_key(run_id))


def read_latest(store: ObjectStore, run_id: str) -> dict | None:
    """LATEST as written (`{"checkpoint", "step"}`), or None when absent or untrustworthy."""
    current = read_versioned(store, latest_path(store, run_id))
    if current is None:
        return None
    pointer, _ = parse_latest(current.data)
    return None if pointer is None else pointer.model_dump()


def manifest_exists(store: ObjectStore, run_id: str, step: int) -> bool:
    with store.errors(f"check of checkpoint {checkpoint_name(step)}"):
        key = checkpoint_key(run_id, checkpoint_name(step), MANIFEST_FILE)
        return key in store.head([key])


def newest_committed_step(store: ObjectStore, run_id: str) -> int | None:
    """The highest step whose checkpoint has a manifest (None if none has)."""
    with store.errors(f"listing of the checkpoints of run {run_id}"):
        names = store.children(checkpoints_dir_key(run_id))
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


def advance_latest(store: ObjectStore, run_id: str, step: int, on_read: Callable[[], None] | None = None) -> LatestMove:
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
        record = LatestPointer.at(target).to_bytes()
        if on_read is not None:
            on_read()
        if current is None:
            won = create_if_absent(store, path, record) is not None
        else:
            won = replace_if_unchanged(store, path, record, current.tag) is not None
        if won:
            return LatestMove(moved=True, step=target, note=note)
        # Another committer wrote LATEST between our read and our write: decide again.
    raise RuntimeError(
        f"LATEST of run {run_id} changed {_MAX_RACES} times while step {step} tried to move it; "
        "more committers are racing than the finalizer lease should allow — check for a second "
        "writer without a lease, then retry"
    )
