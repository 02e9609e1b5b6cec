"""The object operations a publication and a collection need, over full store paths, on any backend.

- What the store holds for each of a checkpoint's objects, without a
  download, is each backend's `remote_objects` (on S3 one HEAD in checksum
  mode each: the recorded sha256, the store's own checksum and ETag; on a
  store that hashes the bytes where they lie, a local disk or memory, their
  own sha256); what that evidence proves is infra/store/uploads.py's
  (`object_problem`, `confirmed`, `matches`), re-exported here.
- `upload_files` uploads many files at once, verified, through the backend's
  `upload_jobs`: a thread pool locally, one asyncio batch on s3fs's loop with
  multipart for large files (infra/store/s3_uploads.py).
- Listing, removal, the leftovers of interrupted local writes and dangling
  multipart uploads, never through a symbolic link out of a local store
  (infra/store/local_tree.py).

This module imports no backend: what differs between them is a method of the
`ObjectStore` protocol (infra/store/base.py).
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Mapping
from pathlib import Path

from trainer_core.run.manifest import FileEntry

from .base import Deadline, ObjectStore, find_files, location_of
from .local_tree import list_links as _local_links
from .local_tree import outside_root, remove_paths
from .local_tree import remove_left_temporaries as _remove_local_temporaries
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
    if jobs:
        store.upload_jobs(jobs, deadline, on_uploaded, concurrency, probe_prefix=base)


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
    store.remove_empty_directories(base, deepest_first)


def abort_dangling_uploads(store: ObjectStore, prefix: str) -> int:
    """Abort unfinished multipart uploads whose key lies under `prefix/` (only S3 leaves any); how many."""
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
    "remove_empty_directories",
    "remove_files",
    "remove_left_temporaries",
    "upload_files",
]
