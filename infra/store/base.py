"""The `ObjectStore` protocol (everything rankflow asks of a store) and what every backend shares.

Backends: LocalStore (local.py), S3Store (s3.py, through s3fs), MemoryStore
(memory.py, for tests); `open_store` (infra/store/__init__.py) picks one by
the URL's scheme. This module also holds the limits every store is held to:
one request's (`StoreTimeouts`) and one operation's overall `Deadline`, past
which a stopped or wedged store is a `StorageTimeoutError` (an `OSError`, so
Prefect retries it) instead of a hang. How a backend's client failures become
OSErrors is the backend's own (`ObjectStore.errors`; S3's: infra/store/s3_errors.py).
"""

from __future__ import annotations

import functools
import posixpath
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Literal, Protocol, runtime_checkable

import fsspec

from .uploads import RemoteObject, Upload, UploadJob

if TYPE_CHECKING:
    from trainer_core.run.manifest import FileEntry


@dataclass(frozen=True)
class StoreTimeouts:
    """Limits of one S3 request: a wedged server fails it instead of blocking forever."""

    connect_s: float = 10.0
    """Seconds to open a connection."""
    read_s: float = 60.0
    """Seconds without a byte from the server before a request is abandoned."""
    max_attempts: int = 3
    """Attempts per request (botocore's standard retry mode) before it fails."""

    @property
    def request_limit_s(self) -> float:
        """The wall-clock limit of one request, every attempt included (infra/store/s3_client.py)."""
        return self.max_attempts * (self.connect_s + self.read_s)

    @classmethod
    def from_settings(cls, storage: "StorageSettings") -> "StoreTimeouts":
        """A run's request limits: `storage.request_timeout_s` to read, at most 10 s of it to connect."""
        request_s = storage.request_timeout_s
        return cls(connect_s=min(10.0, request_s), read_s=request_s)


class StorageSettings(Protocol):
    """What opening a run's store needs from its configuration (`trainer_core.config.StorageSection` is one)."""

    url: str
    timeout_s: float
    request_timeout_s: float


PutMode = Literal["overwrite", "create", "if_match"]


@dataclass(frozen=True)
class Versioned:
    """An object's bytes and the tag a conditional write must name to replace them."""

    data: bytes
    tag: str


class ObjectInfo:
    """What `head` says of one object: its size and the sha256 recorded with it (None: none recorded).

    A backend that hashes the bytes where they lie (a local disk) computes the
    digest only when it is first read, so a caller that compares sizes first
    hashes nothing of an object whose size is already wrong.
    """

    def __init__(self, size: int, sha256: str | None = None, *, digest: Callable[[], str] | None = None):
        self.size = size
        self._sha256, self._digest = sha256, digest

    @functools.cached_property
    def sha256(self) -> str | None:
        return self._digest() if self._digest is not None else self._sha256

    def __repr__(self) -> str:
        return f"ObjectInfo(size={self.size})"


@runtime_checkable
class ObjectStore(Protocol):
    """Everything rankflow asks of an object store. Keys are POSIX paths relative to the store's root."""

    @property
    def url(self) -> str:
        """The `storage.url` the store was opened from (for messages)."""
        ...

    @property
    def root(self) -> str:
        """The full path under the store's filesystem that its keys are relative to (for messages)."""
        ...

    @property
    def identity(self) -> str:
        """What one-time probes are cached under: the same server and bucket (or root) give the same identity."""
        ...

    def describe(self) -> dict:
        """What tells this store from any other, for local records kept per store (no credentials)."""
        ...

    def key(self, *parts: str) -> str:
        """The key of the object at `parts` under the store's root."""
        ...

    def path(self, *parts: str) -> str:
        """The full store path (root included) of the object at `parts`: what the path-level helpers take."""
        ...

    def key_of(self, path: str) -> str:
        """The key of a full store path (`path(...)`): the same object, relative to the root."""
        ...

    def url_of(self, *parts: str) -> str:
        """The URL (or absolute path) a person can use to find the object at the key `parts` name."""
        ...

    def errors(self, what: str) -> AbstractContextManager[None]:
        """Translate client failures during `what` into OSErrors naming the store (ConnectionError, timeouts).

        The other methods leave client failures as they are (callers wrap a whole step in `errors`, so its
        message names the step), except the conditional writes, which confirm a lost answer themselves."""
        ...

    def get(self, key: str) -> Versioned | None:
        """The object's bytes and tag, or None when it does not exist."""
        ...

    def put(
        self,
        key: str,
        data: bytes,
        *,
        mode: PutMode = "overwrite",
        tag: str | None = None,
        deadline: "Deadline | None" = None,
    ) -> str | None:
        """Write a small object whole and atomically, with its sha256 recorded; the new tag.

        `create` writes only when nothing is at `key`, `if_match` only when the
        object still carries `tag`; either returns None when its condition did not hold.
        """
        ...

    def head(self, keys: Sequence[str], *, deadline: "Deadline | None" = None) -> dict[str, ObjectInfo]:
        """Size and recorded sha256 of each key present (absent keys are left out)."""
        ...

    def list(self, prefix: str) -> dict[str, int]:
        """Every object under `prefix/` (path relative to it → size), recursively; empty when there is none."""
        ...

    def children(self, prefix: str, *, dirs_only: bool = False) -> list[str]:
        """The names immediately under `prefix/`: objects and folders alike, or only folders (`dirs_only`)."""
        ...

    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes `start` to `end` (exclusive) of the object at `key`; FileNotFoundError when it is absent."""
        ...

    def remove(self, keys: Sequence[str]) -> None:
        """Remove the objects at `keys`; a missing one is fine."""
        ...

    def open_read(self, key: str) -> AbstractContextManager[BinaryIO]:
        """The object's bytes as a stream read in blocks (no cache)."""
        ...

    def upload(
        self,
        uploads: Sequence[Upload],
        *,
        on_uploaded: Callable[[Upload], None],
        concurrency: int = 8,
        deadline: "Deadline | None" = None,
    ) -> None:
        """Upload files concurrently, verified: bytes not matching their Upload raise StagedFileChanged."""
        ...

    def upload_jobs(
        self,
        jobs: list[UploadJob],
        deadline: Deadline | None,
        on_uploaded: Callable,
        concurrency: int,
        probe_prefix: str,
    ) -> None:
        """`upload` over full store paths (infra/store/objects.py `upload_files`): each job's file to its target,
        verified, largest first; `probe_prefix` is where a store that probes its server first may write a probe."""
        ...

    def remote_objects(
        self, base: str, entries: list[FileEntry], deadline: Deadline | None, concurrency: int = 16
    ) -> dict[str, RemoteObject]:
        """What the store holds of each entry present under the full store path `base`, without a download:
        its size and the evidence of its bytes (what that evidence proves: infra/store/uploads.py)."""
        ...

    def remove_empty_directories(self, base: str, deepest_first: list[str]) -> None:
        """Remove the directories `deepest_first` (full store paths under `base`) once nothing is left in them,
        where the store keeps a directory after its last object (a no-op elsewhere)."""
        ...

    def abort_uploads(self, prefix: str) -> int:
        """Abort unfinished multipart uploads under `prefix/`; how many (0 where every write lands whole)."""
        ...

    def check_writable(self) -> None:
        """Write, read back and remove a probe object; raise StoreSettingError or StoreUnavailable."""
        ...

    def overlaps(self, path: Path) -> bool:
        """Whether the local directory `path` lies inside the store, or the store inside it."""
        ...


@dataclass(frozen=True)
class StoreLocation:
    """A filesystem and the root path under it that a run's objects live in."""

    fs: fsspec.AbstractFileSystem
    root: str
    url: str
    timeouts: StoreTimeouts = field(default_factory=StoreTimeouts)

    @property
    def is_local(self) -> bool:
        return "file" in _protocols(self.fs)

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def key(self, *parts: str) -> str:
        """The key (relative to the store's root) of the object at `parts`."""
        return posixpath.join(*parts) if parts else ""

    def key_of(self, path: str) -> str:
        """The key of a full store path (`path(...)`): the same object, relative to the root."""
        return posixpath.relpath(path, self.root) if path != self.root else ""

    def url_of(self, *parts: str) -> str:
        if self.is_local:
            return self.path(*parts)
        return "s3://" + self.path(*parts)

    def bucket_and_key(self, path: str) -> tuple[str, str]:
        bucket, _, key = path.partition("/")
        return bucket, key

    # Listing and ranged reads through fsspec, shared by the fsspec-backed stores (S3, memory);
    # LocalStore has its own (it must not follow links out of the store).
    def children(self, prefix: str, *, dirs_only: bool = False) -> list[str]:
        base = self.path(prefix).rstrip("/")
        try:
            found = self.fs.ls(base, detail=True)
        except FileNotFoundError:
            return []
        return sorted(
            {
                entry["name"].rstrip("/").rsplit("/", 1)[-1]
                for entry in found
                if entry["name"].rstrip("/") != base and (not dirs_only or entry.get("type") == "directory")
            }
        )

    def read_range(self, key: str, start: int, end: int) -> bytes:
        return self.fs.cat_file(self.path(key), start=start, end=end)  # pyright: ignore[reportReturnType] (fsspec infers str | bytes; a file's bytes)

    def conditional_write(self, key: str, data: bytes, tag: str | None) -> str | None:
        """One unconfirmed conditional write (infra/store/conditional.py confirms it): create `key` when `tag` is
        None, else replace the bytes carrying `tag`; the new tag, or None when refused. Every backend has its own."""
        raise NotImplementedError(f"{type(self).__name__} has no conditional write")

    def forget_lock(self, key: str) -> None:
        """Drop what a conditional write of `key` left beside it (a local sidecar lock file); nothing elsewhere.

        Only for keys nobody else will ever lock (the conditional-write probe's unique name)."""


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def find_files(fs: fsspec.AbstractFileSystem, base: str) -> dict[str, int]:
    """Every object under the full path `base/` of `fs` (relative path → size); empty if there is none.

    In a local store a symbolic link is not an object: it is neither listed
    nor descended into, so nothing reached through one is ever removed.
    """
    prefix = base.rstrip("/") + "/"
    try:
        found = fs.find(prefix, detail=True)
    except FileNotFoundError:
        return {}
    # fsspec's find(detail=True) returns a dict (its inferred type is dict | list).
    return {
        path.removeprefix(prefix): int(info.get("size") or 0)
        for path, info in found.items()  # pyright: ignore[reportAttributeAccessIssue]
        if path.startswith(prefix) and info.get("type", "file") != "directory" and not info.get("islink")
    }


def location_of(store: "ObjectStore") -> StoreLocation:
    """The filesystem and root behind `store`, for the helpers of infra/store/ that work on full store paths.

    Every backend (LocalStore, S3Store, MemoryStore) is a StoreLocation; anything else is refused by name.
    """
    if not isinstance(store, StoreLocation):
        raise TypeError(
            f"{type(store).__name__} is no StoreLocation: the path-level helpers need a backend's "
            "filesystem (infra/store/)"
        )
    return store


class StorageTimeoutError(TimeoutError):
    """A storage operation ran past its deadline; retrying later is safe (an OSError)."""


class Deadline:
    """The overall time limit of one operation (a commit, a cleanup, a report)."""

    def __init__(self, seconds: float | None, what: str, store: "ObjectStore | StoreLocation"):
        self.seconds, self.what, self.store = seconds, what, store
        self._ends = None if seconds is None else time.monotonic() + seconds

    def remaining(self) -> float | None:
        """Seconds left (None: no limit); raises StorageTimeoutError once none are."""
        if self._ends is None:
            return None
        left = self._ends - time.monotonic()
        if left <= 0:
            raise self.error()
        return left

    def error(self) -> StorageTimeoutError:
        return StorageTimeoutError(
            f"{self.what} did not finish within {self.seconds:g} s: object storage at {self.store.url} "
            "stopped answering or is too slow; retry when it is back (raise storage.timeout_s for a slow "
            "store) — finished uploads are kept and are not uploaded again"
        )
