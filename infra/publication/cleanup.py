"""After a commit, or instead of one: clean up a publication's staging, or abort the publication.

`cleanup_staging` removes the local staging of a committed (or aborted)
publication and, holding the finalizer lease, aborts this checkpoint's
dangling multipart uploads and removes the temporary files interrupted writes
of the run left in a local store (a killed commit or upload); a cleanup
failure leaves the checkpoint committed and is retried alone.
`abort_publication` ends a publication that will not be committed (refused
once it is).
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from infra.publication.commit import Observer, PublishSettings, notify, open_journal, read_bytes, remote_dir
from infra.publication.finalizer import finalizer
from infra.publication.journal import HAS_OUTCOME, Journal, PublicationState, TransitionError, journal_path_for
from infra.publication.manifests import MANIFEST_FILE, ManifestError, parse_manifest
from infra.store.base import Deadline, ObjectStore
from infra.store.lease import LEASES_DIR
from infra.store.objects import abort_dangling_uploads, list_files, remove_files, remove_left_temporaries

__all__ = ["CleanupOutcome", "abort_publication", "cleanup_staging", "remove_local_staging"]

S = PublicationState


@dataclass(frozen=True)
class CleanupOutcome:
    step: int | None
    state: str
    removed_bytes: int = 0
    aborted_uploads: int = 0
    stale_objects_removed: int = 0
    temporaries_removed: int = 0
    """Temporary files that interrupted writes of the run had left in a local store."""

    def to_dict(self) -> dict:
        return asdict(self)

    def __getitem__(self, key: str):  # the dict this used to be
        return getattr(self, key)


# -- cleanup ------------------------------------------------------------------


def _local_leftovers(staged_dir: Path) -> list[Path]:
    return [
        staged_dir,
        staged_dir.with_name(staged_dir.name + ".tmp"),
        staged_dir.with_name(staged_dir.name + ".result.json"),
    ]


def _check_not_overlapping(staged_dir: Path, store: ObjectStore) -> None:
    """Refuse to delete a staging that contains the store, or lies inside it (defence in depth)."""
    if store.overlaps(staged_dir):  # only a local store can: its root is then a directory
        staging, root = staged_dir.resolve(), Path(store.root).resolve()
        raise ValueError(
            f"the staging {staging} and the local store {root} overlap; refusing to delete it — "
            "point storage.url and run.work_dir at separate directories"
        )


def remove_local_staging(staged_dir: Path, store: ObjectStore) -> int:
    """Delete the staging and its temporaries; the bytes removed. The journal stays."""
    _check_not_overlapping(staged_dir, store)
    removed = 0
    for leftover in _local_leftovers(staged_dir):
        if leftover.is_dir():
            removed += sum(p.stat().st_size for p in leftover.rglob("*") if p.is_file() and not p.is_symlink())
            shutil.rmtree(leftover)
        elif leftover.exists() or leftover.is_symlink():
            removed += leftover.lstat().st_size
            leftover.unlink()
    return removed


def cleanup_staging(
    staged_dir: Path,
    store: ObjectStore,
    run_id: str,
    *,
    settings: PublishSettings | None = None,
    observer: Observer | None = None,
) -> CleanupOutcome:
    """Clean up after a committed (or aborted) publication; never touches a committed checkpoint."""
    settings = settings or PublishSettings()
    with store.errors(f"cleanup of {staged_dir.name} for run {run_id}"):
        return _cleanup(staged_dir, store, run_id, settings, observer)


def _cleanup(
    staged_dir: Path, store: ObjectStore, run_id: str, settings: PublishSettings, observer: Observer | None
) -> CleanupOutcome:
    if not journal_path_for(staged_dir, store).is_file() and not (staged_dir / MANIFEST_FILE).is_file():
        return CleanupOutcome(step=None, state="nothing staged")
    journal = open_journal(staged_dir, store, run_id)
    state = journal.state
    if state is S.CLEANED:
        return CleanupOutcome(step=journal.step, state=state.value)  # a retried cleanup that already finished
    if state is S.ABORTED:
        return CleanupOutcome(
            step=journal.step, state=state.value, removed_bytes=remove_local_staging(staged_dir, store)
        )
    if state not in HAS_OUTCOME:
        raise TransitionError(
            f"publication {journal.name} is {state.value if state else 'not journaled'}: it is not committed, so "
            "cleanup will not delete its staging — commit it (or abort it) first"
        )
    removed = remove_local_staging(staged_dir, store)
    notify(observer, "local-removed")
    deadline = Deadline(settings.timeout_s, f"cleanup of {journal.name}", store)
    base = remote_dir(store, run_id, journal.step)
    with finalizer(store, run_id, settings.finalizer, purpose=f"cleanup of {journal.name}") as lease:
        notify(observer, "cleanup-lease")
        # Only this checkpoint's prefix, with its trailing '/': other steps'
        # in-flight uploads (and `step-…X` siblings) are never touched.
        aborted = abort_dangling_uploads(store, base)
        # The local-store counterpart: what a killed write of this run left (a commit's, a state upload's, LATEST's).
        # Not under leases/, which processes waiting for a lease write without holding this one.
        temporaries = remove_left_temporaries(store, store.path(run_id), skip=(LEASES_DIR,))
        deadline.remaining()
        published = read_bytes(store, f"{base}/{MANIFEST_FILE}")
        stale: list[str] = []
        if published is not None:
            manifest = parse_manifest(published, f"{base}/{MANIFEST_FILE}", run_id=run_id, step=journal.step)
            stale = sorted(set(list_files(store, base)) - {e.path for e in manifest.files} - {MANIFEST_FILE})
            lease.check()
            remove_files(store, base, stale)
        notify(observer, "store-cleaned")
        lease.check()  # fencing: no outcome is recorded by a run whose lease was taken over
        journal.transition(
            S.CLEANED,
            note=f"removed {removed} staged bytes, aborted {aborted} uploads, removed {len(temporaries)} temporaries",
        )
    return CleanupOutcome(
        step=journal.step,
        state=S.CLEANED.value,
        removed_bytes=removed,
        aborted_uploads=aborted,
        stale_objects_removed=len(stale),
        temporaries_removed=len(temporaries),
    )


# -- abort --------------------------------------------------------------------


def abort_publication(staged_dir: Path, store: ObjectStore, run_id: str, step: int, reason: str) -> Journal:
    """End a publication that will not be committed; removes its temporary files (not a verified staging)."""
    journal = Journal.for_staging(staged_dir, store, run_id, step)
    if journal.state is S.COMMITTING:
        try:
            published = read_bytes(store, f"{remote_dir(store, run_id, step)}/{MANIFEST_FILE}")
        except ManifestError:  # larger than any manifest: not this publication's
            published = None
        if published is not None and published == (staged_dir / MANIFEST_FILE).read_bytes():
            raise TransitionError(
                f"publication {journal.name} is already visible in the store (its manifest is "
                "there); it cannot be aborted — rerun the commit to finish it"
            )
    journal.transition(S.ABORTED, note=reason, error=reason, mirror_required=False)
    for leftover in _local_leftovers(staged_dir)[1:]:
        if leftover.is_dir():
            shutil.rmtree(leftover)
        elif leftover.exists():
            leftover.unlink()
    return journal
