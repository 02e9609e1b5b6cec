"""Garbage collection of a run's store prefix: what a crashed or superseded commit left behind.

Found and removed, holding the run's finalizer lease (so no commit is in
flight), and only under `RUN_ID/` with its trailing '/':
- the objects of a checkpoint that never got its manifest (a commit that died),
  then its emptied directory (a local disk and SeaweedFS keep one);
- objects of a committed checkpoint that its manifest does not list (the
  shards of an earlier layout of the same step);
- temporary files of interrupted local writes;
- dangling multipart uploads (a killed uploader leaves them; they hold space).

A committed checkpoint's listed files, a hidden one a reader still pulls, a checkpoint whose manifest exists but
does not parse (reported, kept for a person to look at), LATEST, the ledger,
journals and leases are never touched.

In a local store nothing is followed through a symbolic link: a run prefix
that links out of the store is refused before anything (a lease included) is
written through it, and a link inside the run is reported and left alone,
never removed through (its target may be anywhere on the machine).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from infra.publication.checkpoints import checkpoint_names, read_manifest
from infra.publication.finalizer import FinalizerSettings, finalizer
from infra.publication.manifests import MANIFEST_FILE, ManifestError, checkpoint_key
from infra.publication.readers import live_readers
from infra.store.base import ObjectStore
from infra.store.durable import TEMP_MARKER
from infra.store.objects import (
    abort_dangling_uploads,
    list_files,
    list_links,
    outside_store,
    remove_empty_directories,
    remove_files,
)
from trainer_core.errors import BadInputError


@dataclass
class GarbageReport:
    run_id: str
    removed: list[str] = field(default_factory=list)
    removed_bytes: int = 0
    aborted_uploads: int = 0
    kept: list[str] = field(default_factory=list)
    """Checkpoints left alone, with the reason (a manifest that does not parse)."""
    dry_run: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def collect_garbage(
    store: ObjectStore, run_id: str, *, dry_run: bool = False, settings: FinalizerSettings | None = None
) -> GarbageReport:
    """Remove the run's orphans (see the module docstring); `dry_run` only reports them."""
    settings = settings or FinalizerSettings(wait_s=60.0)
    report = GarbageReport(run_id=run_id, dry_run=dry_run)
    escaped = outside_store(store, store.path(run_id))
    if escaped is not None:
        raise BadInputError(
            f"{store.path(run_id)} is a symbolic link to {escaped}, outside the store {store.root}: "
            f"gc never follows a link out of a store; give --store the store that holds run {run_id} "
            "itself, or remove the link"
        )
    with store.errors(f"garbage collection of run {run_id}"):
        with finalizer(store, run_id, settings, purpose=f"garbage collection of run {run_id}"):
            for name in checkpoint_names(store, run_id):
                base = store.path(checkpoint_key(run_id, name))
                files = list_files(store, base)
                try:
                    manifest = read_manifest(store, run_id, name)
                except ManifestError as error:
                    report.kept.append(f"{name}: manifest does not parse ({error}); left for inspection")
                    continue
                if manifest is None and (readers := live_readers(store, run_id, name)):
                    # Retention hid it while these pulled it (infra/publication/readers.py): theirs until they finish.
                    report.kept.append(f"{name}: hidden by retention, still being pulled by {', '.join(readers)}")
                    continue
                listed = set() if manifest is None else {entry.path for entry in manifest.files} | {MANIFEST_FILE}
                orphans = sorted(path for path in files if path not in listed)
                report.removed += [f"{base}/{path}" for path in orphans]
                report.removed_bytes += sum(files[path] for path in orphans)
                if not dry_run:
                    remove_files(store, base, orphans)
                    if manifest is None:  # nothing of it is left: its directory must not be listed as a checkpoint
                        remove_empty_directories(store, base, orphans)
            run_root = store.path(run_id)
            report.kept += [
                f"{run_root}/{path}: a symbolic link (to {target}); gc never follows or removes links"
                for path, target in sorted(list_links(store, run_root).items())
            ]
            temporaries = sorted(path for path in list_files(store, run_root) if TEMP_MARKER in path.rsplit("/", 1)[-1])
            report.removed += [f"{run_root}/{path}" for path in temporaries]
            if not dry_run:
                remove_files(store, run_root, temporaries)
                report.aborted_uploads = abort_dangling_uploads(store, run_root)
    return report
