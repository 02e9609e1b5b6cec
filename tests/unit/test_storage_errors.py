"""Client-level S3 failures become the OSError a retry policy understands (`S3Store.errors`: infra/store/s3_errors.py).

Before: a body cut short (aiohttp `ClientPayloadError`, `http.client.IncompleteRead`)
passed through as itself, no OSError: a heartbeat that retries OSErrors died
on it, and callers that catch storage errors did not see one.
"""

from __future__ import annotations

import http.client

import aiohttp
import pytest

from infra.launch.failures import FailureClass, classify_exception
from infra.store.base import StorageTimeoutError
from infra.store.s3 import S3Store


@pytest.fixture
def s3_store():
    import s3fs

    # No request is ever made: only the error translation of a non-local store is under test.
    return S3Store(fs=s3fs.S3FileSystem(anon=True, skip_instance_cache=True), root="bucket/run", url="s3://bucket/run")


@pytest.mark.parametrize(
    "cut",
    [
        aiohttp.ClientPayloadError("Response payload is not completed: received 5 of 272 bytes"),
        http.client.IncompleteRead(b"abc", 10),
    ],
)
def test_a_body_cut_short_is_a_storage_outage(s3_store, cut):
    with pytest.raises(ConnectionError) as caught:
        with s3_store.errors("reading s3://bucket/run/run-state/plan.json"):
            raise cut
    error = caught.value
    assert error.__cause__ is cut and "s3://bucket/run" in str(error) and "cut its answer short" in str(error)
    assert classify_exception(error) is FailureClass.STORAGE_OUTAGE and classify_exception(error).retriable


def test_oserrors_and_timeouts_pass_as_they_were(s3_store):
    with pytest.raises(FileNotFoundError):
        with s3_store.errors("x"):
            raise FileNotFoundError("bucket/run/missing")
    with pytest.raises(StorageTimeoutError):
        with s3_store.errors("x"):
            raise StorageTimeoutError("S3 put_object got no answer within 210 s")


def _translated(status: int, code: str) -> OSError:
    """What s3fs raises for an S3 error answer: its OSError, raised from botocore's ClientError."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    answer = {"Error": {"Code": code, "Message": "said the server"}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return translate_boto_error(ClientError(answer, "PutObject"))  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize(("status", "code"), [(500, "InternalError"), (503, "SlowDown"), (502, "BadGateway")])
def test_a_retried_server_error_is_an_outage_naming_the_store(s3_store, status, code):
    translated = _translated(status, code)
    with pytest.raises(ConnectionError) as caught:
        with s3_store.errors("commit of step-00000008"):
            raise translated
    error = caught.value
    assert error.__cause__ is translated
    assert f"s3://bucket/run answered HTTP {status} on every attempt" in str(error)
    assert classify_exception(error) is FailureClass.STORAGE_OUTAGE


@pytest.mark.parametrize(("status", "code"), [(501, "NotImplemented"), (404, "NoSuchKey"), (412, "PreconditionFailed")])
def test_other_error_answers_pass_as_s3fs_translated_them(s3_store, status, code):
    """A 501 (a header the server does not support) is no outage botocore retried: no "on every attempt"."""
    translated = _translated(status, code)
    with pytest.raises(OSError) as caught:
        with s3_store.errors("commit of step-00000008"):
            raise translated
    assert caught.value is translated
