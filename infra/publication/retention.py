"""Retention: which committed checkpoints stay (`storage.keep_last`, `storage.keep_every`), and removing the rest.

The rule (`checkpoints_to_keep`, the one place it is written): with
keep_last unset every checkpoint stays; otherwise the N newest committed ones,
those whose step is a multiple of keep_every, the one LATEST names and the
newest committed one stay. A checkpoint whose manifest does not parse is not
counted and never touched (left for a person, as `rankflow checkpoints gc`
does).

Removal runs holding the run's finalizer lease (`HeldFinalizer`), so no
commit, cleanup, state upload or other gc runs beside it and LATEST cannot
move meanwhile. Each checkpoint goes in this order, so a gc killed at any
point leaves either a whole checkpoint or an invisible one, and a rerun
finishes the job:

1. skip it if a reader marker is live (readers.py);
2. write `RUN_ID/retired/step-N.json` (why, when): a rerun of the run then
   knows the step was published and removed, and does not export it again;
3. remove MANIFEST.json: the checkpoint is no longer visible to any reader;
4. check the reader markers again: a reader that saw the manifest put its
   marker up before, so its data stay until a later gc (after the marker);
5. remove the data objects, the emptied directory and expired markers.

A retired record next to a manifest (a gc killed between 2 and 3, or a
keep_last raised since) is only an intent: the rule decides again.

`apply_retention` is the whole stage: it takes the lease, removes
checkpoints, then (unless `storage.keep_states`) the segment states nothing
needs any more (infra/runs/state_retention.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from infra.publication.checkpoints import checkpoint_names, read_manifest
from infra.publication.finalizer import FinalizerSettings, HeldFinalizer, finalizer
from infra.publication.latest import manifest_exists, read_latest
from infra.publication.manifests import (
    MANIFEST_FILE,
    ManifestError,
    checkpoint_key,
    checkpoint_name,
    retired_key,
    step_of,
)
from infra.publication.readers import live_readers, remove_reader_markers
from infra.runs.run_state import read_bundle_manifest, segment_bundle
from infra.runs.state_retention import retire_state, states_to_remove
from infra.store.base import ObjectStore
from infra.store.objects import list_files, put_small, remove_empty_directories, remove_files


@dataclass(frozen=True)
class RetentionPolicy:
    """What stays: `storage.keep_last`, `storage.keep_every`, `storage.keep_states` (trainer_core/config.py)."""

    keep_last: int | None = None
    keep_every: int | None = None
    keep_states: bool = True

    @classmethod
    def of(cls, storage) -> RetentionPolicy:
        """The policy of a run's `storage` section."""
        return cls(keep_last=storage.keep_last, keep_every=storage.keep_every, keep_states=storage.keep_states)


def checkpoints_to_keep(committed_steps: list[int], policy: RetentionPolicy, latest_step: int | None) -> set[int]:
    """The committed steps that stay under `policy` (see the module docstring)."""
    if policy.keep_last is None or not committed_steps:
        return set(committed_steps)
    ordered = sorted(committed_steps)
    keep = set(ordered[-policy.keep_last :]) | {ordered[-1]}
    if policy.keep_every is not None:
        keep |= {step for step in ordered if step % policy.keep_every == 0}
    if latest_step is not None:
        keep.add(latest_step)
    return keep


class RetiredCheckpoint(BaseModel):
    """`retired/step-N.json`: the checkpoint of `step` was committed and retention removed it."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    step: int = Field(ge=0)
    reason: str
    retired_at: float

    def to_bytes(self) -> bytes:
        return json.dumps(self.model_dump(), sort_keys=True).encode()


def is_retired(store: ObjectStore, run_id: str, step: int) -> bool:
    """Whether retention removed the checkpoint of `step` (its record is there; its manifest is not)."""
    with store.errors(f"retention record of {checkpoint_name(step)} of run {run_id}"):
        if store.get(retired_key(run_id, step)) is None:
            return False
        return read_manifest(store, run_id, checkpoint_name(step)) is None


@dataclass
class RetentionReport:
    removed: list[str] = field(default_factory=list)
    """Checkpoints removed (manifest and data)."""
    hidden: list[str] = field(default_factory=list)
    """Checkpoints whose manifest was removed but whose data wait for a reader to finish."""
    kept_for_readers: list[str] = field(default_factory=list)
    removed_bytes: int = 0
    states_removed: list[int] = field(default_factory=list)
    """Segments whose training state was removed (infra/runs/state_retention.py)."""
    state_bytes_removed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def remove_checkpoints(
    store: ObjectStore, run_id: str, held: HeldFinalizer, policy: RetentionPolicy, report: RetentionReport
) -> RetentionReport:
    """Remove the committed checkpoints `policy` does not keep, and finish removals a killed gc left; see above."""
    with store.errors(f"retention of the checkpoints of run {run_id}"):
        committed: list[int] = []
        leftovers: list[str] = []  # retired, manifest gone, data maybe left (a reader then, or a killed gc)
        for name in checkpoint_names(store, run_id):
            step = step_of(name)
            assert step is not None  # checkpoint_names lists step-NNNNNNNN names only
            try:
                manifest = read_manifest(store, run_id, name)
            except ManifestError:
                continue  # not counted, not touched
            if manifest is not None:
                committed.append(step)
            elif store.get(retired_key(run_id, step)) is not None:
                leftovers.append(name)
        latest = read_latest(store, run_id)
        keep = checkpoints_to_keep(committed, policy, latest["step"] if latest else None)
        just_hidden: set[str] = set()
        reason = f"storage.keep_last = {policy.keep_last}, storage.keep_every = {policy.keep_every}"
        for step in sorted(set(committed) - keep):
            name = checkpoint_name(step)
            if live_readers(store, run_id, name):
                report.kept_for_readers.append(name)
                continue
            held.check()
            put_small(
                store,
                store.path(retired_key(run_id, step)),
                RetiredCheckpoint(step=step, reason=reason, retired_at=time.time()).to_bytes(),
            )
            held.check()
            store.remove([checkpoint_key(run_id, name, MANIFEST_FILE)])
            leftovers.append(name)
            just_hidden.add(name)
        for name in leftovers:
            if live_readers(store, run_id, name):
                report.hidden.append(name)
                continue
            base = store.path(checkpoint_key(run_id, name))
            files = list_files(store, base)
            held.check()
            remove_files(store, base, sorted(files))
            remove_empty_directories(store, base, sorted(files))
            remove_reader_markers(store, run_id, name)
            if files or name in just_hidden:  # an emptied directory a store kept is no news
                report.removed.append(name)
                report.removed_bytes += sum(files.values())
    return report


@dataclass(frozen=True)
class SegmentStates:
    """What state retention needs to know of the run's plan (tasks/retention.py builds it)."""

    anchor: int
    """The segment whose checkpoint just committed: its state and every later one stay."""
    exported: Callable[[int], bool]
    """Whether the plan exports a checkpoint after segment j."""
    end_step: Callable[[int], int]
    """The step segment j ends at (its checkpoint's step)."""
    state_prefix: Callable[[int], str]
    """Segment j's state directory, relative to the run directory (and to RUN_ID/ in the store)."""
    run_dir: Path


def apply_retention(
    store: ObjectStore,
    run_id: str,
    policy: RetentionPolicy,
    settings: FinalizerSettings,
    states: SegmentStates | None = None,
) -> RetentionReport:
    """Holding the finalizer lease: remove the checkpoints `policy` does not keep, then the states nothing needs."""
    report = RetentionReport()
    with finalizer(store, run_id, settings, purpose=f"retention of run {run_id}") as held:
        remove_checkpoints(store, run_id, held, policy, report)
        if states is None or policy.keep_states or not _holds_its_state(store, run_id, states):
            return report

        def published(segment: int) -> bool:
            step = states.end_step(segment)
            return manifest_exists(store, run_id, step) or is_retired(store, run_id, step)

        for segment in states_to_remove(states.anchor, states.exported, published):
            removed = retire_state(store, run_id, states.run_dir, segment, states.state_prefix(segment), held)
            if removed is not None:
                report.states_removed.append(segment)
                report.state_bytes_removed += removed
    return report


def _holds_its_state(store: ObjectStore, run_id: str, states: SegmentStates) -> bool:
    """Whether the anchor's bundle is stored whole (its manifest is written last) and lists its state."""
    manifest = read_bundle_manifest(store, run_id, segment_bundle(states.anchor))
    prefix = states.state_prefix(states.anchor).rstrip("/") + "/"
    return manifest is not None and any(entry.path.startswith(prefix) for entry in manifest.files)
