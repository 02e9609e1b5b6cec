"""The probe that a store is reachable and writable, and the classes of its failure.

`check_store_writable` (infra/store/writable.py) runs it before anything
else; each backend's `check_writable` is `probe_round_trip`. A tiny probe
object is written, read back and removed under the store's root. The check uses short timeouts and few retries, so a wrong endpoint fails in
seconds with the endpoint named, instead of after the whole run. Messages never
carry credentials: the secret and key values are scrubbed from any client text.

Two outcomes of a failed probe: a *setting* the user must fix (no such bucket,
access denied, a wrong key, no credentials at all, an `AWS_ENDPOINT_URL` that
is not an endpoint, a local path that cannot be written) is bad input
(`StoreSettingError`, a `BadInputError`: exit 2); a store that does not answer
(connection refused, a timeout, a 5xx) may be down or may be the wrong
endpoint, and is a storage outage (`StoreUnavailable`, a `ConnectionError`).
The endpoint is checked before any client is made, so a malformed one never
reaches botocore (which would fail every request the same way, retried or not).
"""

from __future__ import annotations

import os
import uuid
from urllib.parse import urlsplit

from trainer_core.errors import BadInputError

from .base import ObjectStore

PROBE_PREFIX = ".rankflow-probe-"


class StoreUnavailable(ConnectionError):
    """The object store does not answer; the message names the endpoint and what to check."""

    stage = "storage-check"


class StoreSettingError(BadInputError):
    """The store answers but refuses: a missing bucket, a wrong key, no permission. Fix storage.url or the credentials."""

    stage = "storage-check"


# Errors that say the store answered and refused (s3fs maps S3's codes to these).
_SETTING_ERRORS = (PermissionError, FileNotFoundError, NotADirectoryError, FileExistsError, IsADirectoryError)
# botocore's errors for credentials it could not find (or found half of): no request was even signed.
CREDENTIAL_ERRORS = frozenset({"NoCredentialsError", "PartialCredentialsError"})
CREDENTIALS_FIX = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary "
    "credentials) in the environment, or name a configured profile in AWS_PROFILE"
)


def is_credentials_error(error: BaseException) -> bool:
    """Whether `error` (or what it wraps) says botocore found no usable credentials."""
    current: BaseException | None = error
    while current is not None:
        if any(kind.__name__ in CREDENTIAL_ERRORS for kind in type(current).__mro__):
            return True
        current = current.__cause__ or current.__context__
    return False


def endpoint_problem(value: str) -> str | None:
    """What is wrong with an AWS_ENDPOINT_URL value as an S3 endpoint, or None when it is one."""
    try:
        parts = urlsplit(value)
        port = parts.port  # a port that is not a number raises here
    except ValueError as error:
        return f"it does not parse ({error})"
    if parts.scheme not in ("http", "https"):
        return (
            "it has no http:// or https:// scheme"
            if not parts.scheme
            else f"its scheme {parts.scheme!r} is not http or https"
        )
    if not parts.hostname:
        return "it names no host"
    if parts.path not in ("", "/"):
        return f"it has a path ({parts.path!r}); S3 requests go to the bucket at the endpoint's root"
    if parts.query or parts.fragment or parts.username or parts.password:
        return "it has a query, a fragment or user information"
    if port == 0:
        return "its port is 0"
    return None


def check_endpoint_setting(url: str) -> None:
    """Raise StoreSettingError when an S3 store's AWS_ENDPOINT_URL is set but is not an endpoint URL."""
    value = os.environ.get("AWS_ENDPOINT_URL")
    if not url.startswith("s3://") or not value:
        return
    problem = endpoint_problem(value)
    if problem is not None:
        raise StoreSettingError(
            f"AWS_ENDPOINT_URL={_scrub(value)!r} (the endpoint of storage.url={url!r}) is not an S3 endpoint URL: "
            f"{problem}; set AWS_ENDPOINT_URL to http://HOST:PORT or https://HOST:PORT without a path "
            "(e.g. http://127.0.0.1:8333), or unset it to use AWS"
        )


def check_credentials_setting(url: str) -> None:
    """Raise StoreSettingError when only half of an S3 key pair is in the environment, naming the half missing.

    botocore would sign with an empty secret and the server answer SignatureDoesNotMatch, which reads as a wrong
    key; a secret without its key id would be passed over for other credentials, or none."""
    if not url.startswith("s3://"):
        return
    key_id, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if bool(key_id) == bool(secret):
        return
    given, missing = (
        ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY") if key_id else ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID")
    )
    raise StoreSettingError(
        f"{missing} is not set, but {given} is (the credentials of storage.url={url!r}): set {missing} too, "
        f"or unset {given} to use AWS_PROFILE or the instance's role"
    )


def _scrub(text: str) -> str:
    for variable in ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN"):
        value = os.environ.get(variable)
        if value:
            text = text.replace(value, "***")
    return text


def endpoint_of(url: str) -> str:
    if url.startswith("s3://"):
        return os.environ.get("AWS_ENDPOINT_URL") or "the default AWS endpoint (AWS_ENDPOINT_URL is not set)"
    return "the local filesystem"


def probe_round_trip(store: ObjectStore) -> None:
    """Write, read back and remove a probe object at the store's root (a backend's `check_writable`).

    Raises StoreSettingError or StoreUnavailable naming the store, its endpoint and what to check.
    """
    try:
        key = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
        payload = b"rankflow storage probe\n"
        store.put(key, payload)
        found = store.get(key)
        if found is None or found.data != payload:
            raise OSError(f"the probe object {store.url_of(key)} read back different bytes")
        store.remove([key])
    except Exception as error:  # noqa: BLE001 - every client failure becomes one clear message
        raise classified(store.url, error) from None


def classified(url: str, error: Exception) -> StoreSettingError | StoreUnavailable:
    """The preflight's error for a failed probe of `url`: a setting to fix, or a store that does not answer."""
    what = f"storage.url={url!r} at {endpoint_of(url)}"
    cause = f"{type(error).__name__}: {_scrub(str(error))[:300]}"
    if is_credentials_error(error):
        return StoreSettingError(f"{what}: no AWS credentials were found ({cause}); {CREDENTIALS_FIX}")
    if isinstance(error, _SETTING_ERRORS) or (not url.startswith("s3://") and isinstance(error, OSError)):
        return StoreSettingError(
            f"{what} refuses the probe write ({cause}); check the bucket and the credentials "
            "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), or the directory's permissions, or fix storage.url"
        )
    return StoreUnavailable(
        f"{what} is not reachable ({cause}); check the endpoint (AWS_ENDPOINT_URL) and that the server is up, "
        "then run the same command again"
    )
