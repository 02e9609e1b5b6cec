"""Object storage through fsspec: a local directory or S3 (s3fs).

Credentials and the endpoint come from the standard `AWS_*` variables, read
when a filesystem is made (never at import), and never logged.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass

import fsspec


@dataclass(frozen=True)
class StoreLocation:
    """A filesystem and the root path under it that a run's objects live in."""

    fs: fsspec.AbstractFileSystem
    root: str
    url: str

    @property
    def is_local(self) -> bool:
        return "file" in _protocols(self.fs)

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def url_of(self, *parts: str) -> str:
        if self.is_local:
            return self.path(*parts)
        return "s3://" + self.path(*parts)


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def s3_options_from_env() -> dict:
    """s3fs options from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_DEFAULT_REGION."""
    options: dict = {"skip_instance_cache": True}
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        options["key"] = os.environ["AWS_ACCESS_KEY_ID"]
        options["secret"] = os.environ.get("AWS_SECRET_ACCESS_KEY", "")
    if os.environ.get("AWS_ENDPOINT_URL"):
        options["endpoint_url"] = os.environ["AWS_ENDPOINT_URL"]
    region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")
    if region:
        options["client_kwargs"] = {"region_name": region}
    return options


def open_store(url: str) -> StoreLocation:
    """The filesystem for a `storage.url`: `s3://bucket/prefix`, `file://path` or a path."""
    if url.startswith("s3://"):
        import s3fs  # imported here: local runs need no S3 client

        fs = s3fs.S3FileSystem(**s3_options_from_env())
        return StoreLocation(fs=fs, root=url.removeprefix("s3://").rstrip("/"), url=url)
    path = url.removeprefix("file://")
    fs = fsspec.filesystem("file", auto_mkdir=True)
    return StoreLocation(fs=fs, root=os.path.abspath(path), url=url)


def write_small_atomic(store: StoreLocation, path: str, data: bytes) -> None:
    """Write a small object so that readers see the old or the new bytes, never a part.

    One S3 PUT is atomic; on a local filesystem, write aside and rename.
    """
    if store.is_local:
        tmp = f"{path}.tmp-{os.getpid()}"
        store.fs.pipe_file(tmp, data)
        os.replace(tmp, path)
    else:
        store.fs.pipe_file(path, data)


@contextlib.contextmanager
def storage_errors(store: StoreLocation, what: str) -> Iterator[None]:
    """Translate client-level failures (an unreachable endpoint) into ConnectionError.

    s3fs already maps S3's HTTP errors to OSError subclasses; a refused or
    dropped connection surfaces as a botocore exception, which callers and
    Prefect's retries should see as the OSError it is.
    """
    if store.is_local:
        yield
        return
    from botocore.exceptions import BotoCoreError

    try:
        yield
    except BotoCoreError as error:
        raise ConnectionError(f"{what}: object storage at {store.url} is unreachable ({error}); "
                              "check the endpoint and retry — finished uploads are kept") from error
