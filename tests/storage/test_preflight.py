"""The storage check before training: a wrong endpoint fails in seconds, named, without credentials."""

from __future__ import annotations

import socket

import pytest

from infra.store import open_store, writable
from infra.store.preflight import PROBE_PREFIX, StoreSettingError, StoreUnavailable
from infra.store.writable import check_store_writable


def test_a_local_store_is_probed_and_left_clean(tmp_path):
    figures = check_store_writable(str(tmp_path / "store"))
    assert figures["store"] == str(tmp_path / "store") and figures["probe_s"] >= 0  # its timing, for the report
    assert not any(p.name.startswith(PROBE_PREFIX) for p in (tmp_path / "store").rglob("*"))


def test_an_unwritable_local_store_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreSettingError, match=r"storage.url=.*file/store.* refuses the probe write"):
        check_store_writable(str(blocker / "store"))


def test_a_wrong_s3_endpoint_is_an_outage_that_fails_in_seconds_naming_it_without_credentials(monkeypatch):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    secret = "s3cr3t-value-that-must-not-leak"
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLEKEY")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    probed_with = []

    def opened(url, timeouts):
        probed_with.append(timeouts)
        return open_store(url, timeouts)

    monkeypatch.setattr(writable, "open_store", opened)
    with pytest.raises(StoreUnavailable) as raised:
        check_store_writable("s3://bucket/runs")
    # In seconds, whatever the load: the probe's client gives up after two short tries (not botocore's 60 s, 5 tries).
    assert [(t.connect_s, t.read_s, t.max_attempts) for t in probed_with] == [(5.0, 5.0, 2)]
    message = str(raised.value)
    assert f"http://127.0.0.1:{port}" in message and "s3://bucket/runs" in message
    assert secret not in message and "AKIAEXAMPLEKEY" not in message


@pytest.mark.s3
def test_the_real_s3_store_passes_and_keeps_no_probe(s3_env, s3_bucket_url):
    check_store_writable(s3_bucket_url)
    store = open_store(s3_bucket_url)
    leftovers = store.fs.find(store.root) if store.fs.exists(store.root) else []
    assert not [p for p in leftovers if PROBE_PREFIX in p]


@pytest.mark.s3
def test_wrong_credentials_are_reported_without_them(s3_env, s3_bucket_url, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-never-printed")
    with pytest.raises(StoreSettingError) as raised:  # bad input: exit 2
        check_store_writable(s3_bucket_url)
    assert s3_env.endpoint_url in str(raised.value)
    assert "wrong-secret-never-printed" not in str(raised.value)
