"""Object storage through fsspec: a local directory or S3 (s3fs), with time limits.

Credentials and the endpoint come from the standard `AWS_*` variables, read
when a filesystem is made (never at import), and never logged.

Every S3 request has a connect and a read timeout and a bounded number of
attempts (`StoreTimeouts`), and each publication step runs under an overall
`Deadline`: a stopped or wedged server turns into a `StorageTimeoutError` (an
`OSError`, so Prefect retries it) instead of a hang.

Who retries what: botocore retries each request (`max_attempts`: connection
errors, 5xx, and an answer cut short before its end, which aiobotocore reports
as a closed connection); s3fs's own retry loop is off (`fs.retries = 1`) since
it would multiply those attempts for a dead or stopped server. What botocore
cannot see is a streamed body (GetObject) cut short after its headers came:
`cat_file` and `read_body` read those again, up to `max_attempts` times. A
cut answer that outlasts every attempt is a `ConnectionError` like any other
outage (`storage_errors`), never an unclassified client error.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import fsspec

T = TypeVar("T")


@dataclass(frozen=True)
class StoreTimeouts:
    """Limits of one S3 request: a wedged server fails it instead of blocking forever."""

    connect_s: float = 10.0
    """Seconds to open a connection."""
    read_s: float = 60.0
    """Seconds without a byte from the server before a request is abandoned."""
    max_attempts: int = 3
    """Attempts per request (botocore's standard retry mode) before it fails."""


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

    def url_of(self, *parts: str) -> str:
        if self.is_local:
            return self.path(*parts)
        return "s3://" + self.path(*parts)

    def bucket_and_key(self, path: str) -> tuple[str, str]:
        bucket, _, key = path.partition("/")
        return bucket, key


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def s3_options_from_env(timeouts: StoreTimeouts) -> dict:
    """s3fs options from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_DEFAULT_REGION."""
    options: dict = {
        "skip_instance_cache": True,
        # Listings must be fresh: leases, journals and checkpoints change under us.
        "use_listings_cache": False,
        "config_kwargs": {
            "connect_timeout": timeouts.connect_s,
            "read_timeout": timeouts.read_s,
            "retries": {"total_max_attempts": timeouts.max_attempts, "mode": "standard"},
        },
    }
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        options["key"] = os.environ["AWS_ACCESS_KEY_ID"]
        options["secret"] = os.environ.get("AWS_SECRET_ACCESS_KEY", "")
    if os.environ.get("AWS_ENDPOINT_URL"):
        options["endpoint_url"] = os.environ["AWS_ENDPOINT_URL"]
    region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")
    if region:
        options["client_kwargs"] = {"region_name": region}
    return options


def _bounded_s3_filesystem(timeouts: StoreTimeouts):
    """s3fs whose every request has a wall-clock limit.

    botocore's read timeout does not cover every wait: a PutObject to a
    stopped (SIGSTOP) server blocks forever in aiohttp, however small its
    body. Each request therefore gets at most max_attempts × (connect_s +
    read_s), after which it fails with a StorageTimeoutError.
    """
    import asyncio

    import s3fs  # imported here: local runs need no S3 client
    from fsspec.asyn import sync_wrapper

    limit_s = timeouts.max_attempts * (timeouts.connect_s + timeouts.read_s)

    class BoundedS3FileSystem(s3fs.S3FileSystem):
        async def _cat_file(self, path, *args, **kwargs):
            # A body cut short is no request error botocore could retry (its headers had come).
            return await read_body(timeouts, lambda: super(BoundedS3FileSystem, self)._cat_file(path, *args, **kwargs))

        async def _call_s3(self, method, *args, **kwargs):
            try:
                return await asyncio.wait_for(super()._call_s3(method, *args, **kwargs), limit_s)
            except asyncio.TimeoutError as error:
                raise StorageTimeoutError(
                    f"S3 {method} at {self.endpoint_url} got no answer within {limit_s:g} s (storage.request_timeout_s "
                    "per attempt); the server is stopped or overloaded — retry when it answers, finished uploads "
                    "are kept") from error

        # s3fs binds its public call_s3 to the base class's _call_s3: bind it to this one.
        call_s3 = sync_wrapper(_call_s3)

    return BoundedS3FileSystem


def open_store(url: str, timeouts: StoreTimeouts | None = None) -> StoreLocation:
    """The filesystem for a `storage.url`: `s3://bucket/prefix`, `file://path` or a path."""
    timeouts = timeouts or StoreTimeouts()
    if url.startswith("s3://"):
        fs = _bounded_s3_filesystem(timeouts)(**s3_options_from_env(timeouts))
        # s3fs retries connection errors on its own (5 rounds, a class
        # attribute) on top of botocore's attempts: one round leaves the
        # count to StoreTimeouts.max_attempts, so a dead endpoint fails in
        # about max_attempts × read_s. The one thing only s3fs's rounds
        # retried, a streamed body cut short, `read_body` retries instead.
        fs.retries = 1
        return StoreLocation(fs=fs, root=url.removeprefix("s3://").rstrip("/"), url=url, timeouts=timeouts)
    path = url.removeprefix("file://")
    fs = fsspec.filesystem("file", auto_mkdir=True)
    return StoreLocation(fs=fs, root=os.path.abspath(path), url=url, timeouts=timeouts)


def write_small_atomic(store: StoreLocation, path: str, data: bytes) -> None:
    """Write a small object so that readers see the old or the new bytes, never a part.

    One S3 PUT is atomic; on a local filesystem, write aside, fsync and rename.
    """
    if store.is_local:
        from pathlib import Path

        from .durable import write_durable

        write_durable(Path(path), data)
    else:
        store.fs.pipe_file(path, data)


class StorageTimeoutError(TimeoutError):
    """A storage operation ran past its deadline; retrying later is safe (an OSError)."""


class Deadline:
    """The overall time limit of one operation (a commit, a cleanup, a report)."""

    def __init__(self, seconds: float | None, what: str, store: StoreLocation):
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


def cut_answer_errors() -> tuple[type[BaseException], ...]:
    """What an answer cut short or garbled on the way raises (aiohttp, http.client, botocore's parser)."""
    import http.client

    import aiohttp
    from botocore.parsers import ResponseParserError

    return aiohttp.ClientError, http.client.IncompleteRead, ResponseParserError


async def read_body(timeouts: StoreTimeouts, read: Callable[[], Awaitable[T]]) -> T:
    """Run `read` (a request and the reading of its streamed body) again when the body came cut short.

    Up to `timeouts.max_attempts` tries, with a short pause between them; the
    last error propagates (`storage_errors` makes it a ConnectionError).
    """
    import asyncio

    errors = cut_answer_errors()
    for attempt in range(1, timeouts.max_attempts + 1):
        try:
            return await read()
        except errors:
            if attempt >= timeouts.max_attempts:
                raise
            await asyncio.sleep(0.1 * 2 ** (attempt - 1))
    raise AssertionError("unreachable: the loop returns or raises")


def run_async(store: StoreLocation, deadline: Deadline | None, function: Callable[..., Awaitable[T]], *args,
              **kwargs) -> T:
    """Run an s3fs coroutine on the filesystem's event loop, cancelled at the deadline."""
    from fsspec.asyn import sync
    from fsspec.exceptions import FSTimeoutError

    timeout = deadline.remaining() if deadline is not None else None
    try:
        return sync(store.fs.loop, function, *args, timeout=timeout, **kwargs)
    except FSTimeoutError as error:
        if isinstance(error.__cause__, StorageTimeoutError):  # one request's limit, not the deadline
            raise error.__cause__ from None
        assert deadline is not None  # no timeout of ours, no FSTimeoutError
        raise deadline.error() from error


@contextlib.contextmanager
def storage_errors(store: StoreLocation, what: str) -> Iterator[None]:
    """Translate client-level failures (an unreachable endpoint, a cut answer) into ConnectionError.

    s3fs already maps S3's HTTP errors to OSError subclasses; a refused or
    dropped connection surfaces as a botocore exception, and a body cut short
    (or garbled) as an aiohttp or parser error, which callers and Prefect's
    retries should see as the OSError (a storage outage) it is.
    """
    if store.is_local:
        yield
        return
    from botocore.exceptions import BotoCoreError
    from fsspec.exceptions import FSTimeoutError

    try:
        yield
    except BotoCoreError as error:
        raise ConnectionError(f"{what}: object storage at {store.url} is unreachable ({error}); "
                              "check the endpoint and retry — finished uploads are kept") from error
    except FSTimeoutError as error:
        if isinstance(error.__cause__, StorageTimeoutError):  # a request's own limit: its message says more
            raise StorageTimeoutError(f"{what}: {error.__cause__}") from error
        raise StorageTimeoutError(f"{what}: object storage at {store.url} did not answer in time; "
                                  "retry when it is back — finished uploads are kept") from error
    except OSError:
        raise  # already an OSError (aiohttp's ClientOSError among them): callers see it as it is
    except cut_answer_errors() as error:
        raise ConnectionError(f"{what}: object storage at {store.url} cut its answer short "
                              f"({type(error).__name__}: {error}) on every attempt; retry when the connection "
                              "holds — finished uploads are kept") from error
