"""A run's state in the store: the plan, its shards and each segment's training state, as verified bundles.

The store holds the durable part of the run directory under the same
relative paths, and one manifest per bundle:

    RUN_ID/plan.json                           the plan
    RUN_ID/plan/segment-NNNN.safetensors       its shards
    RUN_ID/state/segment-NNNN/…                segment N's training state (weights, AdamW state, meta.json)
    RUN_ID/segments/segment-NNNN.json          segment N's result (losses, figures)
    RUN_ID/run-state/plan.json                 manifest of the plan bundle
    RUN_ID/run-state/segment-NNNN.json         manifest of segment N's bundle (state + result)

Publication follows the checkpoints' rules (infra/publication/commit.py): holding the
run's finalizer lease (so `rankflow checkpoints gc` never runs beside an
upload) and checking the run's lease after each data file and before the
manifest (`StateSettings.finalizer.run_lease_token`), the data objects go
first — each skipped when already there with the right size and sha256 — and
the manifest last; a manifest that differs is removed before any object it
lists changes. A bundle exists only when its manifest does, so an interrupted
upload is never used: its retry finishes it.

Fetching makes the local run directory (`run.work_dir`, a cache) hold what a
stage needs: each file is kept if it matches the stored manifest, otherwise
downloaded (streamed, verified, renamed into place). An object that does not
match its manifest raises `StoredObjectCorrupt` naming it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, model_validator

from infra.publication.finalizer import FinalizerSettings, finalizer
from infra.publication.manifests import (
    MANIFEST_PROBLEMS,
    FileEntry,
    FileList,
    ManifestError,
    decode,
    read_capped,
    refusal,
)
from infra.store.base import Deadline, ObjectStore
from infra.store.objects import SavedFile, matches, put_small, upload_files
from infra.store.verified import fetch_verified, local_copy_matches, sha256_of_file

RUN_STATE_DIR = "run-state"
STATE_FORMAT = "rankflow-run-state/1"
PLAN_BUNDLE = "plan"

Observer = Callable[[str], None]


def segment_bundle(segment_index: int) -> str:
    return f"segment-{segment_index:04d}"


class BundleManifest(BaseModel):
    """A bundle's manifest, checked: its files (relative to the run directory) with size and sha256.

    Validated with `context={"run_id": …, "bundle": …}`, it must be stored as the bundle it names."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    format: Literal["rankflow-run-state/1"]
    run_id: str
    bundle: str
    files: FileList

    @model_validator(mode="after")
    def _stored_as_itself(self, info: ValidationInfo) -> BundleManifest:
        stored = info.context or {}
        if "run_id" in stored and (self.run_id, self.bundle) != (stored["run_id"], stored["bundle"]):
            raise ValueError(_stored_as(self.run_id, self.bundle, stored["run_id"], stored["bundle"]))
        return self

    def to_bytes(self) -> bytes:
        # The bytes of every bundle manifest written before this model: publish_bundle compares them.
        return json.dumps(self.model_dump(), indent=2, sort_keys=True).encode()

    def entry(self, path: str) -> FileEntry:
        for entry in self.files:
            if entry.path == path:
                return entry
        raise KeyError(f"{path} is not in the {self.bundle} bundle of run {self.run_id}")


@dataclass(frozen=True)
class StateSettings:
    """Limits of one bundle upload."""

    timeout_s: float | None = 1800.0
    """Overall deadline of one upload (None: none); past it a retriable StorageTimeoutError."""
    concurrency: int = 8
    finalizer: FinalizerSettings = FinalizerSettings()


def manifest_path(store: ObjectStore, run_id: str, bundle: str) -> str:
    return store.path(run_id, RUN_STATE_DIR, f"{bundle}.json")


def _where(store: ObjectStore, run_id: str, bundle: str) -> str:
    return store.url_of(run_id, RUN_STATE_DIR, f"{bundle}.json")


def _stored_as(found_run: object, found_bundle: object, run_id: str, bundle: str) -> str:
    return f"manifest of {found_run!r}/{found_bundle!r} stored as {run_id!r}/{bundle!r}; refusing it"


def parse_bundle_manifest(data: bytes, where: str, run_id: str, bundle: str) -> BundleManifest:
    raw = decode(data, where)
    try:
        return BundleManifest.model_validate(raw, context={"run_id": run_id, "bundle": bundle})
    except ValidationError as error:
        found = raw if isinstance(raw, dict) else {}
        other = _stored_as(found.get("run_id"), found.get("bundle"), run_id, bundle)
        not_a_bundle = f"not a {STATE_FORMAT} manifest (a newer rankflow wrote it? upgrade to read it)"
        raise refusal(
            error,
            raw,
            where,
            {
                **MANIFEST_PROBLEMS,
                "": lambda _: not_a_bundle,
                "format": lambda _: not_a_bundle,
                "run_id": lambda _: other,
                "bundle": lambda _: other,
            },
        ) from None


def read_bundle_manifest(store: ObjectStore, run_id: str, bundle: str) -> BundleManifest | None:
    """The bundle's manifest if it is in the store; ManifestError if it is there and not valid."""
    path = manifest_path(store, run_id, bundle)
    where = _where(store, run_id, bundle)
    with store.errors(f"reading {where}"):
        found = read_capped(store, store.key_of(path), where)
    if found is None:
        return None
    return parse_bundle_manifest(found, where, run_id, bundle)


def stored_bundle(store: ObjectStore, run_id: str, bundle: str) -> BundleManifest | None:
    """The bundle's manifest if every object it lists is in the store with its size and sha256 (quick check).

    Quick as for checkpoints: on S3 the digest recorded with each object (one
    HEAD), locally the file hashed where it lies; `fetch_bundle` hashes every
    byte it downloads.
    """
    manifest = read_bundle_manifest(store, run_id, bundle)
    if manifest is None:
        return None
    with store.errors(f"checking {_where(store, run_id, bundle)}"):
        found = store.remote_objects(store.path(run_id), list(manifest.files), deadline=None)
    return manifest if all(matches(found.get(e.path), e) for e in manifest.files) else None


def _entries(run_dir: Path, paths: Iterable[str], saved: Mapping[str, SavedFile]) -> list[FileEntry]:
    """Each file's size and sha256: a saved state's recorded digest where given (not read again), else hashed."""
    entries = []
    for path in sorted(paths):
        known = saved.get(path)
        size, digest = (known.size, known.sha256) if known is not None else sha256_of_file(run_dir / path)
        entries.append(FileEntry(path=path, size=size, sha256=digest))
    return entries


def publish_bundle(
    store: ObjectStore,
    run_id: str,
    run_dir: Path,
    bundle: str,
    paths: Iterable[str],
    *,
    settings: StateSettings | None = None,
    observer: Observer | None = None,
    saved: Mapping[str, SavedFile] | None = None,
) -> dict:
    """Upload the files `paths` (relative to `run_dir`) as `bundle`: data first, manifest last.

    `saved` gives, by path, files whose sha256 is known without reading them (a saved state's record,
    trainer_core/run/state_record.py): the manifest takes that digest, and a local store hard-links them.
    Returns figures: files and bytes uploaded and skipped.
    """
    settings = settings or StateSettings()
    saved = saved or {}
    entries = _entries(run_dir, paths, saved)
    manifest_bytes = BundleManifest(format=STATE_FORMAT, run_id=run_id, bundle=bundle, files=entries).to_bytes()
    what = f"upload of {_where(store, run_id, bundle)}"
    deadline = Deadline(settings.timeout_s, what, store)
    base = store.path(run_id)
    with store.errors(what), finalizer(store, run_id, settings.finalizer, purpose=what) as lease:
        published = _published_manifest(store, store.key_of(manifest_path(store, run_id, bundle)))
        if published is not None and published != manifest_bytes:
            # Another version of this bundle is visible: hide it before the objects it lists change.
            lease.check()
            store.remove([store.key_of(manifest_path(store, run_id, bundle))])
        present = store.remote_objects(base, entries, deadline)
        todo = [entry for entry in entries if not matches(present.get(entry.path), entry)]

        def on_uploaded(entry: FileEntry) -> None:
            lease.check()  # fencing, between data files: a run whose lease was taken over stops here
            if observer is not None:
                observer(f"uploaded {entry.path}")

        upload_files(store, run_dir, base, todo, deadline, on_uploaded, settings.concurrency, saved)
        deadline.remaining()
        lease.check()  # fencing (finalizer and run lease): a holder whose lease was taken over must not publish
        if published != manifest_bytes:
            put_small(store, manifest_path(store, run_id, bundle), manifest_bytes, deadline)
    uploaded = sum(e.size for e in todo)
    return {
        "bundle": bundle,
        "num_files_uploaded": len(todo),
        "num_files_skipped": len(entries) - len(todo),
        "bytes_uploaded": uploaded,
        "bytes_skipped": sum(e.size for e in entries) - uploaded,
    }


def _published_manifest(store: ObjectStore, key: str) -> bytes | None:
    """The bundle manifest stored at `key`, to compare with the one to write (None: none). One larger than any
    manifest is no upload's: it compares unequal (b""), unread, and is hidden like any other."""
    try:
        return read_capped(store, key, key)
    except ManifestError:
        return b""


def _unlink_links_between(run_dir: Path, target: Path) -> None:
    """Remove every symlink among `target`'s directories below `run_dir` (the link, never what it points to).

    The run directory's layout is the run's own: a directory there that is a link (to another run's state, a
    shared cache) would have the verified download written through it, outside the run. Without the link the
    file is fetched into a directory of the run's own (`fetch_verified` makes it).
    """
    below = target.parent
    chain = []
    while below != run_dir and run_dir in below.parents:
        chain.append(below)
        below = below.parent
    for directory in reversed(chain):  # outermost first: a link there hides everything under it
        if directory.is_symlink():
            directory.unlink()


def fetch_bundle(
    store: ObjectStore,
    run_id: str,
    run_dir: Path,
    bundle: str,
    *,
    only: Callable[[str], bool] | None = None,
    saved: Mapping[str, SavedFile] | None = None,
) -> dict:
    """Make `run_dir` hold the bundle's files (those `only` selects), verified; returns figures.

    A local file that matches the manifest is kept (one in `saved`, a saved state's untouched file, by its
    recorded digest, without reading it); any other is replaced by a verified download. No manifest:
    FileNotFoundError saying what to rerun.
    """
    saved = saved or {}
    manifest = read_bundle_manifest(store, run_id, bundle)
    if manifest is None:
        raise FileNotFoundError(
            f"{_where(store, run_id, bundle)} is missing: the {bundle} state of run {run_id} was never (completely) "
            "stored, so it cannot be resumed from the store — rerun the stage that writes it (a partial upload is "
            "never used)"
        )
    kept = fetched = fetched_bytes = 0
    with store.errors(f"download of the {bundle} state of run {run_id}"):
        for entry in manifest.files:
            if only is not None and not only(entry.path):
                continue
            target = run_dir / entry.path
            _unlink_links_between(run_dir, target)
            known = saved.get(entry.path)
            if known is not None and (known.size, known.sha256) == (entry.size, entry.sha256):
                kept += 1
                continue
            if local_copy_matches(target, entry):
                kept += 1
                continue
            fetched_bytes += fetch_verified(store, store.path(run_id, entry.path), target, entry)
            fetched += 1
    return {"bundle": bundle, "num_files_kept": kept, "num_files_fetched": fetched, "bytes_fetched": fetched_bytes}
