"""MemoryStore: an object store held in this process's memory (fsspec `memory://`), for fast unit tests.

fsspec's memory filesystem is one dictionary shared by the whole process, so
each MemoryStore lives under a root of its own (`/rankflow-<token>`) and
`close()` deletes it. It cannot serve another process: tests of leases or
commits across processes keep LocalStore or S3Store. A lock serialises the
conditional writes; a tag is the sha256 of the bytes. Configurations cannot
name it (storage.url accepts file and s3 only): tests build it directly.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, cast

import fsspec

from trainer_core.run.manifest import FileEntry

from .base import Deadline, ObjectInfo, PutMode, StoreLocation, Versioned
from .local_digests import hashed_where_they_lie
from .uploads import RemoteObject, Upload, UploadJob, changed

_BLOCK_BYTES = 4 * 2**20


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class MemoryStore(StoreLocation):
    """A fresh, empty in-memory store; `close()` (or `with`) forgets everything it holds."""

    _lock: threading.Lock  # set in __init__ (the dataclass is frozen); serialises the conditional writes

    def __init__(self) -> None:
        token = secrets.token_hex(8)
        super().__init__(fs=fsspec.filesystem("memory"), root=f"/rankflow-{token}", url=f"memory://rankflow-{token}")
        object.__setattr__(self, "_lock", threading.Lock())

    def __enter__(self) -> "MemoryStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Delete every object of this store from the process-wide memory filesystem."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.root, recursive=True)

    @property
    def identity(self) -> str:
        return f"memory:{self.root}"

    def describe(self) -> dict:
        return {"url": self.url, "memory": self.root}

    def url_of(self, *parts: str) -> str:
        return "memory:/" + self.path(*parts)

    def errors(self, what: str):
        return contextlib.nullcontext()

    def _read(self, key: str) -> bytes | None:
        try:
            return self.fs.cat_file(self.path(key))  # pyright: ignore[reportReturnType] (fsspec infers str | bytes)
        except FileNotFoundError:
            return None

    def get(self, key: str) -> Versioned | None:
        data = self._read(key)
        return None if data is None else Versioned(data, _sha256(data))

    def put(
        self,
        key: str,
        data: bytes,
        *,
        mode: PutMode = "overwrite",
        tag: str | None = None,
        deadline: Deadline | None = None,
    ) -> str | None:
        if deadline is not None:
            deadline.remaining()
        if mode == "if_match" and tag is None:
            raise ValueError(f"put(mode='if_match') of {key} names no tag")
        with self._lock:
            current = self._read(key)
            if mode == "create" and current is not None:
                return None
            if mode == "if_match" and (current is None or _sha256(current) != tag):
                return None
            self.fs.pipe_file(self.path(key), bytes(data))
        return _sha256(data)

    def conditional_write(self, key: str, data: bytes, tag: str | None) -> str | None:
        """One conditional write (infra/store/conditional.py confirms it): create when `tag` is None, else replace."""
        return self.put(key, data, mode="create") if tag is None else self.put(key, data, mode="if_match", tag=tag)

    def head(self, keys: Sequence[str], *, deadline: Deadline | None = None) -> dict[str, ObjectInfo]:
        found = {}
        for key in keys:
            if deadline is not None:
                deadline.remaining()
            data = self._read(key)
            if data is not None:
                found[key] = ObjectInfo(len(data), digest=lambda data=data: _sha256(data))
        return found

    def list(self, prefix: str) -> dict[str, int]:
        base = self.path(prefix).rstrip("/") + "/"
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        # fsspec's find(detail=True) returns a dict (its inferred type is dict | list).
        return {
            path.removeprefix(base): int(info.get("size") or 0)
            for path, info in found.items()  # pyright: ignore[reportAttributeAccessIssue]
            if path.startswith(base) and info.get("type") == "file"
        }

    def remove(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(self.path(key))

    @contextlib.contextmanager
    def open_read(self, key: str) -> Iterator[BinaryIO]:
        with self.fs.open(self.path(key), "rb") as handle:
            yield cast("BinaryIO", handle)  # mode "rb": a binary file (fsspec's inferred type also names a text one)

    def upload(
        self,
        uploads: Sequence[Upload],
        *,
        on_uploaded: Callable[[Upload], None],
        concurrency: int = 8,
        deadline: Deadline | None = None,
    ) -> None:
        for upload in sorted(uploads, key=lambda u: -u.size):
            if deadline is not None:
                deadline.remaining()
            data = upload.local.read_bytes()
            digest = _sha256(data)
            if len(data) != upload.size or digest != upload.sha256:
                raise changed(upload.local, upload, digest, len(data))
            self.fs.pipe_file(self.path(upload.key), data)
            on_uploaded(upload)

    def upload_jobs(
        self,
        jobs: list[UploadJob],
        deadline: Deadline | None,
        on_uploaded: Callable,
        concurrency: int,
        probe_prefix: str,
    ) -> None:
        items = {Upload(job.local, self.key_of(job.target), job.item.size, job.item.sha256): job.item for job in jobs}
        self.upload(
            list(items),
            on_uploaded=lambda upload: on_uploaded(items[upload]),
            concurrency=concurrency,
            deadline=deadline,
        )

    def remote_objects(
        self, base: str, entries: list[FileEntry], deadline: Deadline | None, concurrency: int = 16
    ) -> dict[str, RemoteObject]:
        return hashed_where_they_lie(self, base, entries, deadline)

    def remove_empty_directories(self, base: str, deepest_first: list[str]) -> None:
        return None  # fsspec's memory filesystem keeps no folder once its last object is gone

    def abort_uploads(self, prefix: str) -> int:
        return 0  # every write lands whole

    def check_writable(self) -> None:
        return None  # memory is always writable

    def overlaps(self, path: Path) -> bool:
        return False  # no local directory holds it
