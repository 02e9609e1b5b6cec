"""The `ObjectStore` protocol (everything rankflow asks of a store) and what every backend shares.

Backends: LocalStore (local.py), S3Store (s3.py, through s3fs), MemoryStore
(memory.py, for tests); `open_store` (infra/store/__init__.py) picks one by
the URL's scheme. This module also holds the time limits and the
translation of client failures into OSErrors.

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
outage (`storage_errors`), never an unclassified client error; so is a server
error (HTTP 5xx: a server stopping mid-request answers 500 InternalError) that
outlasts botocore's attempts, named by the store it came from.
"""

from __future__ import annotations

import contextlib
import functools
import os
import posixpath
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Literal, Protocol, TypeVar, runtime_checkable

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

    @property
    def request_limit_s(self) -> float:
        """The wall-clock limit of one request, every attempt included (infra/store/s3.py)."""
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


@dataclass(frozen=True)
class Upload:
    """One local file to upload to `key`, with the size and sha256 its bytes must have."""

    local: Path
    key: str
    size: int
    sha256: str


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

    def abort_uploads(self, prefix: str) -> int:
        """Abort unfinished multipart uploads under `prefix/`; how many."""
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


def open_store(storage: "str | StorageSettings", timeouts: StoreTimeouts | None = None) -> "ObjectStore":
    """The store for a `storage.url` (or a storage section): `s3://bucket/prefix`, `file://path` or a path.

    Defined in infra/store/__init__.py (the registry of backends); importable from here too.
    """
    from . import open_store as registered

    return registered(storage, timeouts)


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


def run_async(
    store: StoreLocation, deadline: Deadline | None, function: Callable[..., Awaitable[T]], *args, **kwargs
) -> T:
    """Run an s3fs coroutine on the filesystem's event loop, cancelled at the deadline.

    The deadline cancels the coroutine on its loop, and this waits for its
    clean-up (an upload's record, a multipart abort) before raising: the
    caller releases its lease right after, and nothing of the batch may write
    past that. fsspec's own `timeout` would raise here while the clean-up
    still runs; it only backs the deadline up, one request's limit later.
    """
    from fsspec.asyn import sync
    from fsspec.exceptions import FSTimeoutError

    timeout = deadline.remaining() if deadline is not None else None
    backstop = None if timeout is None else timeout + store.timeouts.request_limit_s
    try:
        # The filesystem is s3fs's (an AsyncFileSystem, which has a loop).
        return sync(store.fs.loop, _within, deadline, timeout, function(*args, **kwargs), timeout=backstop)  # pyright: ignore[reportAttributeAccessIssue, reportReturnType]
    except FSTimeoutError as error:
        if isinstance(error.__cause__, StorageTimeoutError):  # one request's limit, or the deadline
            raise error.__cause__ from None
        assert deadline is not None  # no timeout of ours, no FSTimeoutError
        raise deadline.error() from error


async def _within(deadline: Deadline | None, timeout: float | None, coroutine: Awaitable[T]) -> T:
    """`coroutine`, cancelled after `timeout` seconds (wait_for waits until it has stopped)."""
    import asyncio

    if timeout is None:
        return await coroutine
    try:
        return await asyncio.wait_for(coroutine, timeout)
    except StorageTimeoutError:
        raise  # one request's own limit: its message says more
    except TimeoutError as error:
        assert deadline is not None
        raise deadline.error() from error


_RETRIED_SERVER_ERRORS = frozenset({500, 502, 503, 504})
"""The 5xx botocore's standard mode retries: an outage. A 501 (a header the server does not support) is not one."""


def server_error_status(error: BaseException) -> int | None:
    """The HTTP status of a retried server error (500, 502, 503, 504) that s3fs translated into `error`."""
    from botocore.exceptions import ClientError

    # s3fs raises its OSError from botocore's error; an error already translated here names its store.
    cause = error.__cause__
    if not isinstance(cause, ClientError):
        return None
    status = cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if status in _RETRIED_SERVER_ERRORS else None


@contextlib.contextmanager
def storage_errors(store: "ObjectStore | StoreLocation", what: str) -> Iterator[None]:
    """Translate client-level failures (an unreachable endpoint, a cut answer) into ConnectionError.

    s3fs already maps S3's HTTP errors to OSError subclasses; a refused or
    dropped connection surfaces as a botocore exception, and a body cut short
    (or garbled) as an aiohttp or parser error, which callers and Prefect's
    retries should see as the OSError (a storage outage) it is.
    """
    if isinstance(store, StoreLocation) and store.is_local:  # every backend is a StoreLocation
        yield
        return
    from botocore.exceptions import BotoCoreError
    from fsspec.exceptions import FSTimeoutError

    try:
        yield
    except BotoCoreError as error:
        raise ConnectionError(
            f"{what}: object storage at {store.url} is unreachable ({error}); "
            "check the endpoint and retry — finished uploads are kept"
        ) from error
    except FSTimeoutError as error:
        if isinstance(error.__cause__, StorageTimeoutError):  # a request's own limit: its message says more
            raise StorageTimeoutError(f"{what}: {error.__cause__}") from error
        raise StorageTimeoutError(
            f"{what}: object storage at {store.url} did not answer in time; "
            "retry when it is back — finished uploads are kept"
        ) from error
    except OSError as error:
        status = server_error_status(error)
        if status is None:
            raise  # already an OSError (aiohttp's ClientOSError among them): callers see it as it is
        # s3fs's OSError for a 5xx ("[Errno 121] We encountered an internal error") names no
        # store; it is an outage like a refused connection (the request may or may not have been
        # applied), so it reads like one.
        raise ConnectionError(
            f"{what}: object storage at {store.url} answered HTTP {status} on every attempt ({error}); "
            "retry when it is back — finished uploads are kept"
        ) from error
    except cut_answer_errors() as error:
        raise ConnectionError(
            f"{what}: object storage at {store.url} cut its answer short "
            f"({type(error).__name__}: {error}) on every attempt; retry when the connection "
            "holds — finished uploads are kept"
        ) from error
