"""The bounded s3fs client an S3Store makes its requests through, and how its coroutines are waited for.

Credentials and the endpoint come from the standard `AWS_*` variables, read
when a client is made (never at import), and never logged.

Every request has a connect and a read timeout and a bounded number of
attempts (`StoreTimeouts`), and each publication step runs under an overall
`Deadline` (`run_async`): a stopped or wedged server turns into a
`StorageTimeoutError` (an `OSError`, so Prefect retries it) instead of a hang.

Who retries what: botocore retries each request (`max_attempts`: connection
errors, 5xx, and an answer cut short before its end, which aiobotocore reports
as a closed connection); s3fs's own retry loop is off (`fs.retries = 1`) since
it would multiply those attempts for a dead or stopped server. What botocore
cannot see is a streamed body (GetObject) cut short after its headers came:
`cat_file` and `read_body` read those again, up to `max_attempts` times. A
cut answer that outlasts every attempt is a `ConnectionError` like any other
outage, never an unclassified client error; so is a server error (HTTP 5xx)
that outlasts botocore's attempts (infra/store/s3_errors.py).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import TypeVar

from .base import Deadline, StorageTimeoutError, StoreLocation, StoreTimeouts
from .s3_errors import cut_answer_errors

T = TypeVar("T")


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


async def read_body(timeouts: StoreTimeouts, read: Callable[[], Awaitable[T]]) -> T:
    """Run `read` (a request and the reading of its streamed body) again when the body came cut short.

    Up to `timeouts.max_attempts` tries, with a short pause between them; the
    last error propagates (`S3Store.errors` makes it a ConnectionError).
    """
    errors = cut_answer_errors()
    for attempt in range(1, timeouts.max_attempts + 1):
        try:
            return await read()
        except errors:
            if attempt >= timeouts.max_attempts:
                raise
            await asyncio.sleep(0.1 * 2 ** (attempt - 1))
    raise AssertionError("unreachable: the loop returns or raises")


def _bounded_s3_filesystem(timeouts: StoreTimeouts):
    """s3fs whose every request has a wall-clock limit.

    botocore's read timeout does not cover every wait: a PutObject to a
    stopped (SIGSTOP) server blocks forever in aiohttp, however small its
    body. Each request therefore gets at most max_attempts × (connect_s +
    read_s), after which it fails with a StorageTimeoutError.
    """
    import s3fs  # imported here: local runs need no S3 client
    from fsspec.asyn import sync_wrapper

    limit_s = timeouts.request_limit_s

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
                    "are kept"
                ) from error

        # s3fs binds its public call_s3 to the base class's _call_s3: bind it to this one.
        call_s3 = sync_wrapper(_call_s3)

    return BoundedS3FileSystem


def bounded_s3_filesystem(timeouts: StoreTimeouts):
    """An s3fs client whose requests are bounded by `timeouts`, with s3fs's own retry rounds off."""
    fs = _bounded_s3_filesystem(timeouts)(**s3_options_from_env(timeouts))
    # s3fs retries connection errors on its own (5 rounds, a class
    # attribute) on top of botocore's attempts: one round leaves the
    # count to StoreTimeouts.max_attempts, so a dead endpoint fails in
    # about max_attempts × read_s. The one thing only s3fs's rounds
    # retried, a streamed body cut short, `read_body` retries instead.
    fs.retries = 1
    return fs


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
    if timeout is None:
        return await coroutine
    try:
        return await asyncio.wait_for(coroutine, timeout)
    except StorageTimeoutError:
        raise  # one request's own limit: its message says more
    except TimeoutError as error:
        assert deadline is not None
        raise deadline.error() from error
