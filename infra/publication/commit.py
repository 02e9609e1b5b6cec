"""Publish a staged checkpoint: commit it to the store (cleanup and abort: infra/publication/cleanup.py).

    export (PREPARING → PREPARED) → commit (COMMITTING → COMMITTED) → cleanup (CLEANED)

`commit_checkpoint` holds the run's finalizer lease (one committer per run,
in step order: infra/publication/finalizer.py), uploads the data files concurrently,
skipping each object already in the store with the right size *and* sha256,
writes the manifest last (its presence makes the checkpoint visible), moves
LATEST forward with compare-and-swap, and removes objects of the step that
the new manifest does not list (an earlier layout's shards). Every step is
recorded in the publication's journal (infra/publication/journal.py), so a retry resumes
where the last try stopped; one that already has its outcome returns at once
if its checkpoint still verifies in the store (confirm depth, infra/publication/checkpoints.py),
and raises CheckpointDoesNotVerify if it does not: the step is exported and
committed again (tasks/publish.py), never reported committed while damaged.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from infra.publication.checkpoints import verify_checkpoint
from infra.publication.finalizer import FinalizerSettings, finalizer
from infra.publication.journal import Journal, PublicationState, TransitionError, journal_path_for
from infra.publication.latest import advance_latest, read_latest
from infra.publication.manifests import (
    LATEST_FILE,
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    CheckpointManifest,
    ManifestError,
    checkpoint_key,
    checkpoint_name,
    parse_manifest,
    read_capped,
)
from infra.store.base import Deadline, ObjectStore
from infra.store.objects import (
    StagedFileChanged,
    list_files,
    matches,
    put_small,
    remove_files,
    upload_files,
)

__all__ = [
    "CheckpointDoesNotVerify",
    "CommitOutcome",
    "EXPORT_AGAIN",
    "LATEST_FILE",
    "MANIFEST_FILE",
    "PublishSettings",
    "StagedFileChanged",
    "StagingMissing",
    "checkpoint_name",
    "commit_checkpoint",
    "read_latest",
    "read_staged_manifest",
]

Observer = Callable[[str], None]
S = PublicationState


class StagingMissing(FileNotFoundError):
    """The staging has no manifest (deleted, or its export never finished): export the step again."""


class CheckpointDoesNotVerify(OSError):
    """A publication recorded as committed whose checkpoint no longer verifies in the store: export it again.

    An OSError: the store does not hold what was written to it (bytes changed
    under it, objects deleted) — a fault of the store, not of the input."""


EXPORT_AGAIN = (StagedFileChanged, StagingMissing, CheckpointDoesNotVerify)
"""The commit errors that a new export of the step (from its stored state), then a commit, resolve."""


@dataclass(frozen=True)
class PublishSettings:
    """Limits of one commit or cleanup."""

    timeout_s: float | None = 1800.0
    """Overall deadline of one commit or cleanup (None: none); past it a retriable StorageTimeoutError."""
    concurrency: int = 8
    """Files uploaded at once."""
    finalizer: FinalizerSettings = field(default_factory=FinalizerSettings)


@dataclass(frozen=True)
class CommitOutcome:
    checkpoint_url: str
    step: int
    num_files_uploaded: int
    num_files_skipped: int
    bytes_uploaded: int
    latest_moved: bool
    wall_s: float
    bytes_skipped: int = 0
    latest_step: int | None = None
    already_committed: bool = False
    """The journal already said COMMITTED: nothing was uploaded or rewritten."""
    stale_objects_removed: int = 0
    notes: tuple[str, ...] = ()
    uploaded: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return asdict(self)


def notify(observer: Observer | None, event: str) -> None:
    if observer is not None:
        observer(event)


def remote_dir(store: ObjectStore, run_id: str, step: int) -> str:
    return store.path(checkpoint_key(run_id, checkpoint_name(step)))


# -- the staging ------------------------------------------------------------


def read_staged_manifest(staged_dir: Path, run_id: str | None = None) -> tuple[CheckpointManifest, bytes]:
    """The staged manifest, checked: safe paths, and every file a regular file inside the staging with its size."""
    path = staged_dir / MANIFEST_FILE
    if not path.is_file():
        raise StagingMissing(
            f"{staged_dir} has no {MANIFEST_FILE} (its export did not finish, or the staging was "
            "deleted); the step is exported again"
        )
    data = path.read_bytes()
    manifest = parse_manifest(data, str(path), run_id=run_id)
    root = staged_dir.resolve()
    for entry in manifest.files:
        file = staged_dir / entry.path
        if file.is_symlink() or root not in file.resolve().parents:
            raise ManifestError(f"{path}: {entry.path} is a link or leaves the staging; refusing to upload it")
        if not file.is_file() or file.stat().st_size != entry.size:
            raise StagedFileChanged(
                f"staged file {file} does not match its manifest entry (missing or another size); "
                "the export is re-done, not uploaded"
            )
    return manifest, data


def _step_of_staging(staged_dir: Path, run_id: str, store: ObjectStore) -> int:
    journal_file = journal_path_for(staged_dir, store)
    if journal_file.is_file():
        probe = Journal(journal_file, None, run_id, 0).load()
        if probe.record is not None:
            return probe.record.step
    manifest, _ = read_staged_manifest(staged_dir, run_id)
    return manifest.step


def open_journal(staged_dir: Path, store: ObjectStore, run_id: str, step: int | None = None) -> Journal:
    """The journal of the publication staged at `staged_dir` (local, or the store's mirror)."""
    if step is None:
        step = _step_of_staging(staged_dir, run_id, store)
    journal = Journal.for_staging(staged_dir, store, run_id, step)
    staged_manifest = staged_dir / MANIFEST_FILE
    if (
        journal.from_mirror
        and journal.record is not None
        and staged_manifest.is_file()
        and journal.record.manifest_sha256 != hashlib.sha256(staged_manifest.read_bytes()).hexdigest()
    ):
        journal.forget()  # the mirror is another publication of this step; this staging is a new one
    return journal


# -- commit -----------------------------------------------------------------


def commit_checkpoint(
    staged_dir: Path,
    store: ObjectStore,
    run_id: str,
    *,
    settings: PublishSettings | None = None,
    observer: Observer | None = None,
) -> CommitOutcome:
    """Commit the checkpoint staged at `staged_dir`; see the module docstring."""
    settings = settings or PublishSettings()
    with store.errors(f"commit of {staged_dir.name} for run {run_id}"):
        return _commit(staged_dir, store, run_id, settings, observer)


def _already_committed(journal: Journal, store: ObjectStore, run_id: str, started: float) -> CommitOutcome:
    step, record = journal.step, journal.record
    assert record is not None  # it has an outcome
    report = verify_checkpoint(store, run_id, checkpoint_name(step), confirm=True)
    if not report.verified:
        raise CheckpointDoesNotVerify(
            f"publication {journal.name} is {record.state.value}, but its checkpoint at "
            f"{store.url_of(checkpoint_key(run_id, checkpoint_name(step)))} does not verify "
            f"({'; '.join(report.problems)}); the step is exported again from its stored state and committed"
        )
    latest = read_latest(store, run_id)
    return CommitOutcome(
        checkpoint_url=store.url_of(checkpoint_key(run_id, checkpoint_name(step))),
        step=step,
        num_files_uploaded=0,
        num_files_skipped=record.num_files,
        bytes_uploaded=0,
        bytes_skipped=record.num_bytes,
        latest_moved=False,
        latest_step=latest["step"] if latest else None,
        already_committed=True,
        wall_s=time.perf_counter() - started,
    )


def _commit(
    staged_dir: Path, store: ObjectStore, run_id: str, settings: PublishSettings, observer: Observer | None
) -> CommitOutcome:
    started = time.perf_counter()
    journal = open_journal(staged_dir, store, run_id)
    if journal.has_outcome:
        return _already_committed(journal, store, run_id, started)  # a retry with an outcome: nothing to redo
    _refuse_unfinished(journal)
    manifest, manifest_bytes = _staged_manifest_of(journal, staged_dir, run_id)
    target = _Target(
        store,
        run_id,
        manifest,
        manifest_bytes,
        Deadline(settings.timeout_s, f"commit of {checkpoint_name(manifest.step)} for run {run_id}", store),
    )
    with finalizer(store, run_id, settings.finalizer, step=journal.step) as lease:
        notify(observer, "lease")
        held = lease.record
        assert held is not None  # the finalizer lease is held
        journal.transition(
            S.COMMITTING,
            note=f"finalizer {lease.owner} gen {held.generation}",
            manifest_sha256=target.manifest_sha256,
            num_files=len(manifest.files),
            num_bytes=manifest.num_bytes,
        )
        # One listing finds what is there; only objects of the right size need a HEAD for their digest.
        listing = list_files(store, target.base)
        published = _hide_another_commit(target, listing, lease)
        todo = _objects_to_upload(target, listing)
        _upload(target, staged_dir, todo, journal, lease, settings, observer)
        _write_manifest(target, published, lease, observer)
        move = _advance_latest(target, lease, observer)
        stale = _remove_stale(target, listing, lease)
        journal.transition(S.COMMITTED, note="; ".join(target.notes) or "manifest and LATEST written", error=None)
        notify(observer, "committed")
    return target.outcome(todo, move, stale, started)


@dataclass
class _Target:
    """What one commit writes: the staged manifest's checkpoint, under its run's checkpoints/ in the store."""

    store: ObjectStore
    run_id: str
    manifest: CheckpointManifest
    manifest_bytes: bytes
    deadline: Deadline
    notes: list[str] = field(default_factory=list)

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def name(self) -> str:
        return checkpoint_name(self.manifest.step)

    @property
    def base(self) -> str:
        return remote_dir(self.store, self.run_id, self.manifest.step)

    @property
    def manifest_sha256(self) -> str:
        return hashlib.sha256(self.manifest_bytes).hexdigest()

    def outcome(self, todo: list, move, stale: list[str], started: float) -> CommitOutcome:
        manifest = self.manifest
        return CommitOutcome(
            checkpoint_url=self.store.url_of(checkpoint_key(self.run_id, self.name)),
            step=self.step,
            num_files_uploaded=len(todo),
            num_files_skipped=len(manifest.files) - len(todo),
            bytes_uploaded=sum(e.size for e in todo),
            bytes_skipped=manifest.num_bytes - sum(e.size for e in todo),
            latest_moved=move.moved,
            latest_step=move.step,
            stale_objects_removed=len(stale),
            notes=tuple(self.notes),
            uploaded=tuple(e.path for e in todo),
            wall_s=time.perf_counter() - started,
        )


def _refuse_unfinished(journal: Journal) -> None:
    """An aborted publication never finishes; one still PREPARING has no finished export to commit."""
    if journal.state is S.ABORTED and journal.record is not None:  # a state is its record's
        raise TransitionError(
            f"publication {journal.name} was ABORTED ({journal.record.error}); it cannot be "
            "committed — an aborted publication never finishes: export the step again to publish it"
        )
    if journal.state is S.PREPARING:
        raise TransitionError(
            f"publication {journal.name} is PREPARING; its export did not finish — rerun the export stage, then commit"
        )


def _staged_manifest_of(journal: Journal, staged_dir: Path, run_id: str) -> tuple[CheckpointManifest, bytes]:
    """The staged manifest, checked against the journal's step; staging found without a journal opens one."""
    try:
        manifest, manifest_bytes = read_staged_manifest(staged_dir, run_id)
    except StagedFileChanged as error:
        if journal.state is not None:
            journal.transition(S.PREPARING, note=f"staging changed: {error}", mirror_required=False)
        raise
    if manifest.step != journal.step:
        raise ManifestError(
            f"{staged_dir}: staged manifest of step {manifest.step} under the journal of "
            f"step {journal.step}; export the step again"
        )
    if journal.state is None:  # staged outside the export stage: this commit opens the journal
        journal.transition(
            S.PREPARED,
            note="staging found without a journal",
            manifest_sha256=hashlib.sha256(manifest_bytes).hexdigest(),
            num_files=len(manifest.files),
            num_bytes=manifest.num_bytes,
            mirror=False,
        )
    return manifest, manifest_bytes


def _hide_another_commit(target: _Target, listing: dict[str, int], lease) -> bytes | None:
    """The manifest already published for this step; another commit's is removed before its files change."""
    store, manifest_path = target.store, f"{target.base}/{MANIFEST_FILE}"
    published = None
    if MANIFEST_FILE in listing:
        # One larger than a manifest may be is no commit's: it compares unequal (b""), unread, and is hidden.
        published = read_bytes(store, manifest_path) if listing[MANIFEST_FILE] <= MAX_MANIFEST_BYTES else b""
    if published is not None and published != target.manifest_bytes:
        # A different commit of this step is visible: hide it before its files change under readers.
        lease.check()
        store.remove([store.key_of(manifest_path)])
        target.notes.append(f"replaced an earlier commit of {target.name} with another manifest")
    return published


def _objects_to_upload(target: _Target, listing: dict[str, int]) -> list:
    """The manifest's files the store does not hold with these bytes (a HEAD only for same-size candidates)."""
    files = target.manifest.files
    candidates = [entry for entry in files if listing.get(entry.path) == entry.size]
    present = target.store.remote_objects(target.base, candidates, target.deadline)
    return [entry for entry in files if not matches(present.get(entry.path), entry)]


def _upload(
    target: _Target,
    staged_dir: Path,
    todo: list,
    journal: Journal,
    lease,
    settings: PublishSettings,
    observer: Observer | None,
) -> None:
    def on_uploaded(entry) -> None:
        lease.check()  # fencing, between data files: a run whose lease was taken over records nothing more
        journal.record_upload(entry.path, entry.size, entry.sha256)
        notify(observer, f"uploaded {entry.path}")

    try:
        upload_files(target.store, staged_dir, target.base, todo, target.deadline, on_uploaded, settings.concurrency)
    except StagedFileChanged as error:
        journal.transition(S.PREPARING, note=f"staging changed: {error}", mirror_required=False)
        raise


def _write_manifest(target: _Target, published: bytes | None, lease, observer: Observer | None) -> None:
    """The manifest last, once every file it lists is in place: readers see the whole checkpoint or none."""
    target.deadline.remaining()
    lease.check()  # fencing: a finalizer whose lease was taken over must not publish
    if published != target.manifest_bytes:
        notify(observer, "manifest")
        put_small(target.store, f"{target.base}/{MANIFEST_FILE}", target.manifest_bytes)
    notify(observer, "manifest-written")


def _advance_latest(target: _Target, lease, observer: Observer | None):
    # LATEST is compare-and-swapped (never moved back), but a run whose lease was taken over must not move it.
    lease.check()
    move = advance_latest(target.store, target.run_id, target.step, on_read=lambda: notify(observer, "latest-read"))
    if move.note:
        target.notes.append(move.note)
    notify(observer, "latest")
    return move


def _remove_stale(target: _Target, listing: dict[str, int], lease) -> list[str]:
    """Objects the listing found that this manifest does not list: an earlier layout's shards."""
    stale = sorted(set(listing) - {entry.path for entry in target.manifest.files} - {MANIFEST_FILE})
    lease.check()  # before deleting, and before the outcome is recorded (the journal and its mirror)
    remove_files(target.store, target.base, stale)
    return stale


def read_bytes(store: ObjectStore, path: str) -> bytes | None:
    """A stored manifest's bytes (None: none); ManifestError, unread, for one larger than a manifest may be."""
    return read_capped(store, store.key_of(path), path)
