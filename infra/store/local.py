"""LocalStore: a directory on this machine's filesystem as an object store.

Small objects are written aside, fsynced and renamed (infra/store/durable.py);
`create` publishes with os.link and `if_match` compares the sha256 under a
sidecar flock (infra/store/conditional.py), so two processes of this machine
never both win. Uploads copy, hash and fsync in a thread pool. A digest is the
sha256 of the bytes where they lie, computed only when it is first asked for.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from trainer_core.storage_url import overlap

from .base import Deadline, ObjectInfo, PutMode, StoreLocation, StoreTimeouts, Upload, Versioned
from .verified import sha256_of_file


class LocalStore(StoreLocation):
    """The store under `root`, an absolute directory (`file://PATH` or a plain path)."""

    @classmethod
    def open(cls, url: str, timeouts: StoreTimeouts) -> "LocalStore":
        import fsspec

        return cls(fs=fsspec.filesystem("file", auto_mkdir=True), root=os.path.abspath(url.removeprefix("file://")),
                   url=url, timeouts=timeouts)

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

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite", tag: str | None = None,
            deadline: Deadline | None = None) -> str | None:
        from .conditional import create_if_absent, replace_if_unchanged
        from .durable import write_durable

        path = self.path(key)
        if mode == "create":
            return create_if_absent(self, path, data)
        if mode == "if_match":
            if tag is None:
                raise ValueError(f"put(mode='if_match') of {key} names no tag")
            return replace_if_unchanged(self, path, data, tag)
        if deadline is not None:
            deadline.remaining()
        write_durable(Path(path), data)
        return hashlib.sha256(data).hexdigest()

    def conditional_write(self, key: str, data: bytes, tag: str | None) -> str | None:
        """One conditional write, unconfirmed: create when `tag` is None, else replace the tagged bytes."""
        from .conditional import _create_local, _replace_local

        path = Path(self.path(key))
        return _create_local(path, data) if tag is None else _replace_local(path, data, tag)

    def head(self, keys: Sequence[str], *, deadline: Deadline | None = None) -> dict[str, ObjectInfo]:
        found = {}
        for key in keys:
            path = Path(self.path(key))
            if path.is_file():
                found[key] = ObjectInfo(path.stat().st_size, digest=lambda path=path: sha256_of_file(path)[1])
        return found

    def list(self, prefix: str) -> dict[str, int]:
        from .objects import list_files

        return list_files(self, self.path(prefix))

    def children(self, prefix: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove(self, keys: Sequence[str]) -> None:
        from .objects import remove_files

        remove_files(self, self.root, list(keys))

    @contextlib.contextmanager
    def open_read(self, key: str) -> Iterator[BinaryIO]:
        with open(self.path(key), "rb") as handle:
            yield handle

    def upload(self, uploads: Sequence[Upload], *, on_uploaded: Callable[[Upload], None], concurrency: int = 8,
               deadline: Deadline | None = None) -> None:
        from .objects import UploadJob, upload_jobs

        jobs = [UploadJob(upload, upload.local, self.path(upload.key)) for upload in uploads]
        upload_jobs(self, jobs, deadline, on_uploaded, concurrency, probe_prefix=self.root)

    def abort_uploads(self, prefix: str) -> int:
        return 0  # a local copy is renamed into place whole: nothing is ever left half-uploaded

    def check_writable(self) -> None:
        from .preflight import check_store_writable

        check_store_writable(self.url)

    def overlaps(self, path: Path) -> bool:
        return overlap(path, self.root) is not None  # the one overlap rule (trainer_core/storage_url.py)
