"""LocalStore: a directory on this machine's filesystem as an object store.

Small objects are written aside, fsynced and renamed (infra/store/durable.py);
`create` publishes with os.link and `if_match` compares the sha256, each under
an exclusive flock on a sidecar lock file, so two processes of this machine
never both win (infra/store/conditional.py confirms a write whose answer was
lost). Uploads copy, hash and fsync in a thread pool; a saved state's file,
fsync'd with its digest known, is hard-linked instead on the same filesystem. A digest is the sha256
of the bytes where they lie, computed only when it is first asked for.
Symbolic links are never followed out of the root (infra/store/local_tree.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import BinaryIO

import fsspec

from trainer_core.run.manifest import FileEntry
from trainer_core.storage_url import overlap

from .base import Deadline, ObjectInfo, PutMode, StoreLocation, StoreTimeouts, Versioned, find_files
from .conditional import put_conditional
from .durable import create_exclusive, fsync_dir, temp_name, write_durable
from .local_digests import hashed_where_they_lie
from .local_tree import remove_empty_directories as _remove_empty_local
from .local_tree import remove_paths
from .preflight import probe_round_trip
from .uploads import RemoteObject, Upload, UploadJob, changed
from .verified import BLOCK_BYTES, sha256_of_file


@contextlib.contextmanager
def _local_lock(path: Path) -> Iterator[None]:
    """An exclusive flock on PATH's sidecar lock file, across processes of this machine."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = _lock_path(path)
    descriptor = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # closing releases the lock


def _real_directory(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path)


def _lock_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


def _create_local(path: Path, data: bytes) -> str | None:
    with _local_lock(path):
        created = create_exclusive(path, data)
    return hashlib.sha256(data).hexdigest() if created else None


def _replace_local(path: Path, data: bytes, tag: str) -> str | None:
    with _local_lock(path):
        try:
            current = hashlib.sha256(path.read_bytes()).hexdigest()
        except FileNotFoundError:
            return None
        if current != tag:
            return None
        write_durable(path, data)
    return hashlib.sha256(data).hexdigest()


def _linked(job: UploadJob, tmp: Path) -> bool:
    """Hard-link a saved state's file to `tmp` (same filesystem); False, nothing left, where it cannot be.

    The link shares the bytes the save fsync'd and the record's digest describes: the same inode, size and
    mtime after the link say nothing was written in between (a write changes the mtime, an edit that puts
    it back changes the inode or, checked by the caller's trust rule beforehand, the ctime)."""
    saved = job.saved
    if saved is None:
        return False
    try:
        os.link(job.local, tmp, follow_symlinks=False)
    except OSError:  # another filesystem (EXDEV), no hard links there, …: copy instead
        return False
    stat = tmp.lstat()
    if (stat.st_size, stat.st_mtime_ns, stat.st_ino) != (saved.size, saved.mtime_ns, saved.inode):
        tmp.unlink(missing_ok=True)
        return False
    return True


def _upload_local(jobs: list[UploadJob], deadline: Deadline | None, on_uploaded: Callable, concurrency: int) -> None:
    """Copy, hash and fsync each job in a thread pool, largest first; a copy whose bytes changed is not placed.

    A saved state's file (`UploadJob.saved`) is hard-linked instead where the store shares its filesystem: it
    is fsync'd already and its digest known (infra/store/uploads.py `SavedFile`)."""

    def copy(job: UploadJob):
        if deadline is not None:
            deadline.remaining()
        entry, local, target = job.item, job.local, Path(job.target)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_name(target)
        if _linked(job, tmp):
            try:
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
            fsync_dir(target.parent)
            return entry
        digest, size = hashlib.sha256(), 0
        try:
            with local.open("rb") as source, tmp.open("wb") as sink:
                while block := source.read(BLOCK_BYTES):
                    digest.update(block)
                    size += len(block)
                    sink.write(block)
                sink.flush()
                os.fsync(sink.fileno())
            if size != entry.size or digest.hexdigest() != entry.sha256:
                raise changed(local, entry, digest.hexdigest(), size)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        return entry

    pool = ThreadPoolExecutor(max_workers=concurrency)
    futures = [pool.submit(copy, job) for job in sorted(jobs, key=lambda j: -j.item.size)]
    try:
        for future in as_completed(futures):
            on_uploaded(future.result())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # a failure stops the files not yet started


class LocalStore(StoreLocation):
    """The store under `root`, an absolute directory (`file://PATH` or a plain path)."""

    @classmethod
    def open(cls, url: str, timeouts: StoreTimeouts) -> "LocalStore":
        return cls(
            fs=fsspec.filesystem("file", auto_mkdir=True),
            root=os.path.abspath(url.removeprefix("file://")),
            url=url,
            timeouts=timeouts,
        )

    @property
    def identity(self) -> str:
        return f"file:{os.path.realpath(self.root)}"

    def describe(self) -> dict:
        return {"url": self.url, "path": os.path.realpath(self.root)}

    def url_of(self, *parts: str) -> str:
        return self.path(*parts)

    def errors(self, what: str):
        return contextlib.nullcontext()

    def get(self, key: str) -> Versioned | None:
        try:
            data = Path(self.path(key)).read_bytes()
        except FileNotFoundError:
            return None
        return Versioned(data, hashlib.sha256(data).hexdigest())

    def put(
        self,
        key: str,
        data: bytes,
        *,
        mode: PutMode = "overwrite",
        tag: str | None = None,
        deadline: Deadline | None = None,
    ) -> str | None:
        if mode != "overwrite":
            return put_conditional(self, key, data, mode, tag)
        if deadline is not None:
            deadline.remaining()
        write_durable(Path(self.path(key)), data)
        return hashlib.sha256(data).hexdigest()

    def conditional_write(self, key: str, data: bytes, tag: str | None) -> str | None:
        """One conditional write, unconfirmed: create when `tag` is None, else replace the tagged bytes."""
        path = Path(self.path(key))
        return _create_local(path, data) if tag is None else _replace_local(path, data, tag)

    def head(self, keys: Sequence[str], *, deadline: Deadline | None = None) -> dict[str, ObjectInfo]:
        found = {}
        for key in keys:
            path = Path(self.path(key))
            if path.is_file():
                found[key] = ObjectInfo(path.stat().st_size, digest=lambda path=path: sha256_of_file(path)[1])
        return found

    def forget_lock(self, key: str) -> None:
        _lock_path(Path(self.path(key))).unlink(missing_ok=True)

    def list(self, prefix: str) -> dict[str, int]:
        return find_files(self.fs, self.path(prefix))

    def children(self, prefix: str, *, dirs_only: bool = False) -> list[str]:
        directory = self.path(prefix)
        try:
            names = os.listdir(directory)
        except (FileNotFoundError, NotADirectoryError):
            return []
        # A link to a folder is no folder of the store: it could lead anywhere (gc never follows one).
        return sorted(name for name in names if not dirs_only or _real_directory(os.path.join(directory, name)))

    def read_range(self, key: str, start: int, end: int) -> bytes:
        with open(self.path(key), "rb") as handle:
            handle.seek(start)
            return handle.read(max(0, end - start))

    def remove(self, keys: Sequence[str]) -> None:
        remove_paths(self.root, [self.path(key) for key in keys])

    @contextlib.contextmanager
    def open_read(self, key: str) -> Iterator[BinaryIO]:
        with open(self.path(key), "rb") as handle:
            yield handle

    def upload(
        self,
        uploads: Sequence[Upload],
        *,
        on_uploaded: Callable[[Upload], None],
        concurrency: int = 8,
        deadline: Deadline | None = None,
    ) -> None:
        jobs = [UploadJob(upload, upload.local, self.path(upload.key)) for upload in uploads]
        self.upload_jobs(jobs, deadline, on_uploaded, concurrency)

    def upload_jobs(
        self,
        jobs: list[UploadJob],
        deadline: Deadline | None,
        on_uploaded: Callable,
        concurrency: int,
        probe_prefix: str | None = None,
    ) -> None:
        """Copy every job into place (a thread pool, largest first); `probe_prefix` is S3's, unused here."""
        if jobs:
            _upload_local(jobs, deadline, on_uploaded, concurrency)

    def remote_objects(
        self, base: str, entries: list[FileEntry], deadline: Deadline | None, concurrency: int = 16
    ) -> dict[str, RemoteObject]:
        return hashed_where_they_lie(self, base, entries, deadline)

    def remove_empty_directories(self, base: str, deepest_first: list[str]) -> None:
        """A local disk keeps a directory after its last file is removed (never through a link: local_tree.py)."""
        _remove_empty_local(self.root, base, deepest_first)

    def abort_uploads(self, prefix: str) -> int:
        return 0  # a local copy is renamed into place whole: nothing is ever left half-uploaded

    def check_writable(self) -> None:
        probe_round_trip(self)

    def overlaps(self, path: Path) -> bool:
        return overlap(path, self.root) is not None  # the one overlap rule (trainer_core/storage_url.py)
