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


@pytest.mark.parametrize(
    ("given", "missing"),
    [("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"), ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID")],
)
def test_half_a_key_pair_is_bad_input_naming_the_missing_variable(monkeypatch, given, missing):
    """Botocore signs with an empty secret and the server answers SignatureDoesNotMatch ("a wrong key"): the
    store refuses to open first, naming the variable that is missing and never the value that is set."""
    from infra.store import open_store
    from infra.store.preflight import StoreSettingError
    from infra.store.writable import check_store_writable

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(given, "AKIAIOSFODNN7EXAMPLE")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens: no request may be needed
    for check in (lambda: open_store("s3://rankflow/runs"), lambda: check_store_writable("s3://rankflow/runs")):
        with pytest.raises(StoreSettingError) as raised:
            check()
        message = str(raised.value)
        assert message.startswith(f"{missing} is not set, but {given} is") and f"set {missing} too" in message
        assert "AKIAIOSFODNN7EXAMPLE" not in message and classify_exception(raised.value) is FailureClass.BAD_INPUT
