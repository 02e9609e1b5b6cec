"""The object operations a publication and a collection need, over full store paths, on any backend.

- `remote_objects` says what the store holds for each of a checkpoint's
  objects, without a download: on S3 one HEAD in checksum mode each (the
  recorded sha256, the store's own checksum and ETag: S3Store.remote_objects),
  on a store that hashes the bytes where they lie (a local disk, memory) their
  own sha256. What that evidence proves is infra/store/uploads.py's
  (`object_problem`, `confirmed`, `matches`).
- `upload_files` uploads many files at once, verified: a thread pool locally
  (LocalStore), one asyncio batch on s3fs's loop with multipart for large
  files (infra/store/s3_uploads.py), any other backend through its `upload`.
- Listing, removal, the leftovers of interrupted local writes and dangling
  multipart uploads, never through a symbolic link out of a local store
  (infra/store/local_tree.py).

This module imports the backends; none of them imports it.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Mapping
from pathlib import Path

from infra.publication.manifests import FileEntry

from .base import Deadline, ObjectStore, Upload, find_files, location_of
from .local import LocalStore
from .local_tree import list_links as _local_links
from .local_tree import outside_root, remove_paths
from .local_tree import remove_empty_directories as _remove_empty_local
from .local_tree import remove_left_temporaries as _remove_local_temporaries
from .s3 import S3Store
from .uploads import (
    CHECKSUM_METADATA_KEY,
    ETAG_METADATA_KEY,
    SHA256_METADATA_KEY,
    RemoteObject,
    SavedFile,
    StagedFileChanged,
    UploadJob,
    confirmed,
    matches,
    object_problem,
)

# -- what is already there ----------------------------------------------------


def remote_objects(
    store: ObjectStore, base: str, entries: list[FileEntry], deadline: Deadline | None, concurrency: int = 16
) -> dict[str, RemoteObject]:
    """The entries present under `base`, with their size and recorded digest."""
    if isinstance(store, S3Store):
        return store.remote_objects(base, entries, deadline, concurrency)
    # A store that hashes the bytes where they lie (a local disk, memory): its digest is the bytes' own.
    by_key = {store.key_of(f"{base}/{entry.path}"): entry for entry in entries}
    found = {}
    for key, info in store.head(list(by_key), deadline=deadline).items():
        entry = by_key[key]
        # Only hash what could match (the digest is computed when first read); a wrong size is a mismatch already.
        same_size = info.size == entry.size
        found[entry.path] = RemoteObject(info.size, info.sha256 if same_size else None, hashed=same_size)
    return found


# -- uploads -----------------------------------------------------------------


def upload_files(
    store: ObjectStore,
    staged_dir: Path,
    base: str,
    entries: list[FileEntry],
    deadline: Deadline | None,
    on_uploaded: Callable[[FileEntry], None],
    concurrency: int = 8,
    saved: Mapping[str, SavedFile] | None = None,
) -> None:
    """Upload `entries` from `staged_dir` to `base`, concurrently; `on_uploaded` runs as each one lands.

    `saved`: the entries (by path) that are a saved state's untouched files, which a local store hard-links."""
    saved = saved or {}
    jobs = [
        UploadJob(entry, staged_dir / entry.path, f"{base.rstrip('/')}/{entry.path}", saved.get(entry.path))
        for entry in entries
    ]
    upload_jobs(store, jobs, deadline, on_uploaded, concurrency, probe_prefix=base)


def upload_jobs(
    store: ObjectStore,
    jobs: list[UploadJob],
    deadline: Deadline | None,
    on_uploaded: Callable,
    concurrency: int,
    probe_prefix: str,
) -> None:
    """Upload every job concurrently (a thread pool locally, one asyncio batch on S3), largest first."""
    if not jobs:
        return
    if isinstance(store, (LocalStore, S3Store)):
        store.upload_jobs(jobs, deadline, on_uploaded, concurrency, probe_prefix=probe_prefix)
        return
    # any other backend uploads through its own protocol method
    items = {Upload(job.local, store.key_of(job.target), job.item.size, job.item.sha256): job.item for job in jobs}
    store.upload(
        list(items), on_uploaded=lambda upload: on_uploaded(items[upload]), concurrency=concurrency, deadline=deadline
    )


# -- small objects, removal, dangling uploads ---------------------------------------


def put_small(store: ObjectStore, path: str, data: bytes, deadline: Deadline | None = None) -> None:
    """Write a small object whole (atomically), with its digest recorded like any uploaded file."""
    store.put(store.key_of(path), data, deadline=deadline)


def list_files(store: ObjectStore, base: str) -> dict[str, int]:
    """Every object under `base/` (relative path → size); empty if there is none (links are no objects)."""
    return find_files(location_of(store).fs, base)


def list_links(store: ObjectStore, base: str) -> dict[str, str]:
    """The symbolic links under `base/` of a local store (relative path → target); none on S3."""
    location = location_of(store)
    return _local_links(location.fs, base) if location.is_local else {}


def outside_store(store: ObjectStore, path: str) -> str | None:
    """Where `path` of a local store really is when a symbolic link takes it out of the store's root, else None."""
    return outside_root(store.root, path) if location_of(store).is_local else None


def remove_files(store: ObjectStore, base: str, relative_paths: list[str]) -> None:
    """Remove objects under `base/`; in a local store never through a link out of the store (a link itself may go)."""
    if not relative_paths:
        return
    paths = [f"{base.rstrip('/')}/{p}" for p in relative_paths]
    if location_of(store).is_local:
        remove_paths(store.root, paths)
        return
    store.remove([store.key_of(path) for path in paths])


def remove_left_temporaries(store: ObjectStore, prefix: str, *, skip: tuple[str, ...] = ()) -> list[str]:
    """Remove the temporary files interrupted local writes left under `prefix/`; the paths removed.

    Local stores only (an S3 PUT leaves nothing partial; its unfinished
    multipart uploads are aborted by `abort_dangling_uploads`). The caller
    holds the lease that serialises the writers of `prefix`, so a temporary
    there is a dead (or fenced-off) writer's — except this process's own and
    those under the folders in `skip` (written by processes that hold no such
    lease, such as lease records).
    """
    location = location_of(store)
    if not location.is_local:
        return []
    return _remove_local_temporaries(location.fs, store.root, prefix, skip=skip)


def remove_empty_directories(store: ObjectStore, base: str, relative_paths: list[str]) -> None:
    """Remove `base/` and the directories of `relative_paths` under it once nothing is left in them.

    Both a local disk and SeaweedFS keep a directory after its last object is
    removed, and a reader would list it as a checkpoint. On S3 the directory
    is its key with a trailing '/' (deleting it is a no-op where the store
    has no such entry, as on AWS); it is deleted only after a fresh listing
    finds no object left under `base/`.
    """
    base = base.rstrip("/")
    directories = {base} | {posixpath.join(base, posixpath.dirname(p)) for p in relative_paths if "/" in p}
    for path in list(directories):
        while path != base:  # every ancestor up to base
            directories.add(path)
            path = posixpath.dirname(path)
    deepest_first = sorted(directories, key=lambda d: d.count("/"), reverse=True)
    if location_of(store).is_local:
        _remove_empty_local(store.root, base, deepest_first)
    elif isinstance(store, S3Store):
        store.remove_empty_directories(base, deepest_first)
    # no other backend keeps an empty folder


def abort_dangling_uploads(store: ObjectStore, prefix: str) -> int:
    """Abort unfinished multipart uploads whose key lies under `prefix/` (S3 only); how many."""
    if not isinstance(store, S3Store):
        return 0
    return store.abort_uploads(store.key_of(prefix))


__all__ = [
    "CHECKSUM_METADATA_KEY",
    "ETAG_METADATA_KEY",
    "RemoteObject",
    "SHA256_METADATA_KEY",
    "StagedFileChanged",
    "UploadJob",
    "abort_dangling_uploads",
    "confirmed",
    "list_files",
    "list_links",
    "matches",
    "object_problem",
    "outside_store",
    "put_small",
    "remote_objects",
    "remove_empty_directories",
    "remove_files",
    "remove_left_temporaries",
    "upload_files",
    "upload_jobs",
]
