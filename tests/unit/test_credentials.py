"""Missing S3 credentials are bad input wherever they surface, never a storage outage that a retry could fix.

The reference is botocore's own error, raised by botocore itself (a client
with no credentials signing a request), wrapped the way the storage layer
wraps it.
"""

from __future__ import annotations

import botocore.session
import pytest
from botocore.exceptions import NoCredentialsError

from infra.launch.failures import FailureClass, classify_exception
from infra.store.preflight import is_credentials_error
from tasks.retry_policy import retry_if_retriable


def _no_credentials_error(tmp_path, monkeypatch) -> NoCredentialsError:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    client = botocore.session.get_session().create_client(
        "s3", region_name="us-east-1", endpoint_url="http://127.0.0.1:9"
    )
    with pytest.raises(NoCredentialsError) as raised:
        client.head_bucket(Bucket="rankflow")
    return raised.value


class _State:
    def __init__(self, error):
        self.data = error


def test_missing_credentials_are_bad_input_even_wrapped_as_a_connection_error(tmp_path, monkeypatch):
    cause = _no_credentials_error(tmp_path, monkeypatch)
    try:
        raise ConnectionError("commit: object storage at s3://rankflow/runs is unreachable") from cause
    except ConnectionError as wrapped:
        error = wrapped
    for raised in (cause, error):
        assert is_credentials_error(raised)
        assert classify_exception(raised) is FailureClass.BAD_INPUT
        assert not retry_if_retriable(None, None, _State(raised))
    assert classify_exception(ConnectionError("a real outage")) is FailureClass.STORAGE_OUTAGE
