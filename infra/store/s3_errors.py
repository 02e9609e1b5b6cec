"""What an S3 store's client failures are as OSErrors (`S3Store.errors`, infra/store/s3.py).

s3fs already maps S3's HTTP errors to OSError subclasses; what it leaves as
itself is a client-level failure: a refused or dropped connection (a botocore
exception), a body cut short or garbled on the way (aiohttp, http.client,
botocore's parser), a wait past its limit (fsspec's FSTimeoutError). Each
becomes the ConnectionError or StorageTimeoutError (an outage, which callers
and Prefect's retries understand) naming the store; so does a server error
(HTTP 5xx: a server stopping mid-request answers 500 InternalError) that
outlasts botocore's attempts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .base import StorageTimeoutError, StoreLocation

_RETRIED_SERVER_ERRORS = frozenset({500, 502, 503, 504})
"""The 5xx botocore's standard mode retries: an outage. A 501 (a header the server does not support) is not one."""


def cut_answer_errors() -> tuple[type[BaseException], ...]:
    """What an answer cut short or garbled on the way raises (aiohttp, http.client, botocore's parser)."""
    import http.client

    import aiohttp
    from botocore.parsers import ResponseParserError

    return aiohttp.ClientError, http.client.IncompleteRead, ResponseParserError


def _server_error_status(error: BaseException) -> int | None:
    """The HTTP status of a retried server error (500, 502, 503, 504) that s3fs translated into `error`."""
    from botocore.exceptions import ClientError

    # s3fs raises its OSError from botocore's error; an error already translated here names its store.
    cause = error.__cause__
    if not isinstance(cause, ClientError):
        return None
    status = cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if status in _RETRIED_SERVER_ERRORS else None


@contextlib.contextmanager
def s3_errors(store: StoreLocation, what: str) -> Iterator[None]:
    """Translate client-level failures during `what` (an unreachable endpoint, a cut answer) into OSErrors."""
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
        status = _server_error_status(error)
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
