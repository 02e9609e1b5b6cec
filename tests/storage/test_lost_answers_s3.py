"""Answers lost or cut short between the real SeaweedFS and rankflow (a loopback proxy in between).

tests/storage/cutting_proxy.py forwards every request to the server and, by
rule, closes the connection instead of returning the server's answer (the
server applied the request), or returns only the first bytes of a body.

- A lost answer to a lease's conditional PUT: botocore retries the PUT, the
  server refuses the retry (412, the first one changed the object). Before:
  the first write of a run lease made the run `RunAlreadyActive` against
  itself, and one lost renewal made a healthy lease lost.
- A GetObject body cut short: before, a raw aiohttp `ClientPayloadError` (no
  OSError, unclassified as storage) ended the upload at the first cut, since
  `fs.retries = 1` turns s3fs's own retry off; now the body is read again, and
  a cut that outlasts every attempt is a `ConnectionError`, a storage outage.

Reference: the bytes in the store, read directly from the server.
"""

from __future__ import annotations

import time

import pytest

from infra.launch.failures import FailureClass, classify_exception
from infra.runs.run_lease import acquire_run_lease, check_run_lease
from infra.runs.run_state import fetch_bundle, manifest_path, publish_bundle
from infra.store import open_store
from infra.store.lease import LeaseRecord
from tests.waits import wait_for

pytestmark = pytest.mark.s3

RUN = "proxied-run"


@pytest.fixture
def direct(s3_server, s3_bucket_url):
    """The same bucket prefix, read straight from the server (no proxy): the reference."""
    return s3_server.filesystem(), s3_bucket_url.removeprefix("s3://")


def conditional_put_of(path_suffix: str, header: str):
    return lambda request: request.method == "PUT" and header in request.headers and request.path.endswith(path_suffix)


def test_the_first_run_lease_write_whose_answer_was_lost_holds_the_lease(proxy, direct, s3_bucket_url):
    store = open_store(s3_bucket_url)
    proxy.drop_answer(conditional_put_of("/leases/run.json", "if-none-match"))
    lease = acquire_run_lease(store, RUN, ttl_s=30, wait_s=0)  # before: RunAlreadyActive, held by itself
    try:
        assert [action for action, _ in proxy.applied] == ["drop"]
        fs, root = direct
        stored = LeaseRecord.from_bytes(fs.cat_file(f"{root}/{RUN}/leases/run.json"))
        assert stored == lease.record and stored.generation == 1
    finally:
        lease.release()
    assert LeaseRecord.from_bytes(direct[0].cat_file(f"{direct[1]}/{RUN}/leases/run.json")).released


def test_a_run_lease_renewal_whose_answer_was_lost_keeps_the_run_going(proxy, direct, s3_bucket_url):
    """Before: the heartbeat took its own renewal for a takeover and stopped; the fence failed a ttl later."""
    store = open_store(s3_bucket_url)
    proxy.drop_answer(conditional_put_of("/leases/run.json", "if-match"))
    lease = acquire_run_lease(store, RUN, ttl_s=3.0, wait_s=0)  # heartbeat every ttl / 3
    try:
        wait_for(lambda: proxy.applied, "the heartbeat's renewal whose answer is lost")
        time.sleep(4.0)  # time that must pass, not a wait for an event: past the ttl, only later renewals keep it
        check_run_lease(store, RUN, lease.record.token, "segment 1")
        lease.check()
        fs, root = direct
        stored = LeaseRecord.from_bytes(fs.cat_file(f"{root}/{RUN}/leases/run.json"))
        assert stored.token == lease.record.token and stored.expires_at > time.time() and not lease.lost
    finally:
        assert lease.release()


def _run_dir(tmp_path):
    run_dir = tmp_path / "work"
    (run_dir / "plan").mkdir(parents=True)
    (run_dir / "plan.json").write_bytes(b'{"plan": 1}')
    (run_dir / "plan" / "segment-0000.safetensors").write_bytes(bytes(range(256)) * 40)
    return run_dir


def test_a_body_cut_short_is_read_again(proxy, direct, s3_bucket_url, tmp_path):
    store = open_store(s3_bucket_url)
    run_dir = _run_dir(tmp_path)
    paths = ["plan.json", "plan/segment-0000.safetensors"]
    publish_bundle(store, RUN, run_dir, "plan", paths)
    # The retry of the plan upload reads the stored manifest and the finalizer lease: cut both bodies once.
    proxy.cut_body(lambda request: request.method == "GET" and request.path.endswith("/run-state/plan.json"), 5)
    proxy.cut_body(lambda request: request.method == "GET" and request.path.endswith("/leases/finalizer.json"), 5)
    figures = publish_bundle(store, RUN, run_dir, "plan", paths)  # before: aiohttp ClientPayloadError
    assert sorted(action for action, _ in proxy.applied) == ["cut", "cut"]
    assert figures["num_files_skipped"] == 2 and figures["num_files_uploaded"] == 0
    fresh = tmp_path / "fresh"
    fetch_bundle(store, RUN, fresh, "plan", only=lambda path: path == "plan.json")
    fs, root = direct
    assert (fresh / "plan.json").read_bytes() == fs.cat_file(f"{root}/{RUN}/plan.json") == b'{"plan": 1}'
    assert fs.exists(f"{root}/{RUN}/run-state/plan.json")


def test_a_body_cut_on_every_attempt_is_a_storage_outage(proxy, s3_bucket_url, tmp_path):
    store = open_store(s3_bucket_url)
    run_dir = _run_dir(tmp_path)
    publish_bundle(store, RUN, run_dir, "plan", ["plan.json"])
    proxy.cut_body(
        lambda request: request.method == "GET" and request.path.endswith("/run-state/plan.json"), 5, times=100
    )
    with pytest.raises(OSError) as caught:  # before: ClientPayloadError, no OSError at all
        publish_bundle(store, RUN, run_dir, "plan", ["plan.json"])
    error = caught.value
    assert isinstance(error, ConnectionError) and "cut its answer short" in str(error) and s3_bucket_url in str(error)
    assert classify_exception(error) is FailureClass.STORAGE_OUTAGE and classify_exception(error).retriable
    assert len([a for a, _ in proxy.applied]) == store.timeouts.max_attempts  # read again, then given up
    assert store.fs.exists(manifest_path(store, RUN, "plan"))  # it failed before writing anything
