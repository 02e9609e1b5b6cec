"""The lease (infra/store/lease.py) with real processes, on a local store and on SeaweedFS.

One holder at a time across processes; a holder killed with SIGKILL is taken
over at once on its machine; another machine's holder only once its lease
expired; a holder whose lease was taken over learns it before writing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest

from infra.store import open_store
from infra.store.lease import Lease, LeaseHeldError, LeaseLostError, LeaseRecord, read_lease
from tests.storage.processes import result, spawn, wait_ready
from tests.waits import wait_for


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store_url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store")
    request.getfixturevalue("s3_env")
    return request.getfixturevalue("s3_bucket_url")


def test_two_processes_never_hold_the_lease_at_once(store_url):
    holders = [
        spawn("tests.storage.lease_holder", [store_url, "run", "--rounds", "6", "--hold-s", "0.15"]) for _ in range(2)
    ]
    for holder in holders:
        wait_ready(holder)
    intervals = sorted(tuple(i) for holder in holders for i in result(holder))
    assert len(intervals) == 12
    for (_start, end, generation), (next_start, _, next_generation) in zip(intervals, intervals[1:]):
        assert end <= next_start, "two processes held the lease at the same time"
        assert next_generation == generation + 1


def test_a_killed_holder_on_this_machine_is_taken_over_at_once(store_url):
    holder = spawn("tests.storage.lease_holder", [store_url, "run", "--hang", "--ttl-s", "600"])
    wait_ready(holder)
    assert holder.stdout.readline().strip() == "held"
    store = open_store(store_url)
    waiter = Lease.for_run(store, "lease-run", "run", ttl_s=600)
    with pytest.raises(LeaseHeldError, match=f"held by {socket.gethostname()}:{holder.pid}"):
        waiter.acquire(wait_s=0.5)
    os.killpg(holder.pid, signal.SIGKILL)
    holder.wait()
    waiter.acquire(wait_s=300)  # bounded far below the 600 s expiry: only the dead holder's takeover fits in it
    assert waiter.record.generation == 2
    waiter.release()


def test_another_machines_lease_is_taken_over_only_after_it_expires(store_url):
    store = open_store(store_url)
    path = store.path("lease-run", "leases", "run.json")
    now = time.time()
    foreign = LeaseRecord(
        owner="gpu-node-3:77",
        token="t" * 32,
        generation=5,
        acquired_at=now,
        renewed_at=now,
        expires_at=now + 3.0,
        ttl_s=3.0,
        host="gpu-node-3",
        pid=77,
    )
    store.fs.pipe_file(path, foreign.to_bytes())
    lease = Lease.for_run(store, "lease-run", "run", ttl_s=30)
    with pytest.raises(LeaseHeldError, match="gpu-node-3:77 .*generation 5"):
        lease.acquire(wait_s=0.5)
    lease.acquire(wait_s=300)  # ends as soon as the 3 s expiry has passed
    assert time.time() >= foreign.expires_at and lease.record.generation == 6
    assert read_lease(store, path).owner == lease.owner
    lease.release()
    assert read_lease(store, path) is None


def test_a_holder_that_stopped_renewing_learns_it_lost_the_lease(store_url):
    store = open_store(store_url)
    stalled = Lease.for_run(store, "lease-run", "run", owner="stalled", ttl_s=1.0)
    stalled.acquire()  # no heartbeat: as if the process was paused (SIGSTOP) past its ttl
    time.sleep(1.2)
    taker = Lease.for_run(store, "lease-run", "run", owner="taker", ttl_s=30)
    taker.acquire(wait_s=2)
    with pytest.raises(LeaseLostError, match="taken over"):
        stalled.check()
    with pytest.raises(LeaseLostError):
        stalled.renew()
    assert not stalled.release()  # never deletes the new holder's lease
    assert read_lease(store, taker.path).owner == "taker"
    taker.release()


def test_the_heartbeat_keeps_a_lease_past_its_ttl(store_url):
    store = open_store(store_url)
    with Lease.for_run(store, "lease-run", "run", ttl_s=3.0, heartbeat_s=0.2).hold() as held:
        first_expiry = read_lease(store, held.path).expires_at
        # Past the first ttl, and held still: a renewal stored after the time the unrenewed lease would have expired.
        wait_for(lambda: read_lease(store, held.path).renewed_at > first_expiry, "a renewal past the first ttl")
        held.check()
        other = Lease.for_run(store, "lease-run", "run", ttl_s=3.0)
        with pytest.raises(LeaseHeldError):
            other.acquire(wait_s=0.3)
    assert read_lease(store, held.path) is None


def test_an_unreadable_lease_object_is_taken_over(store_url):
    store = open_store(store_url)
    path = store.path("lease-run", "leases", "run.json")
    store.fs.pipe_file(path, b"{ not a lease")
    with Lease.for_run(store, "lease-run", "run").hold(wait_s=1) as held:
        assert json.loads(store.fs.cat_file(path))["token"] == held.record.token


@pytest.mark.s3
def test_a_fence_rides_out_a_minute_of_503s_from_the_real_server(proxy, s3_bucket_url):
    """SeaweedFS, behind a proxy answering 503 SlowDown to every read of the run lease for 60 s (issue 31, item 9).

    The 60 s pass on a fake clock that the fence's pauses advance, so the test
    waits for none of them; the errors are the server's, through s3fs. One
    request per try (botocore's own pauses would be real ones). Before: the
    first 503 failed the stage.
    """
    from infra.runs.run_lease import acquire_run_lease, check_run_lease
    from infra.store.base import StoreTimeouts
    from tasks.retry_policy import OutageBackoff, ride_out_outage

    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    store = open_store(s3_bucket_url, StoreTimeouts(connect_s=5.0, read_s=10.0, max_attempts=1))
    lease = acquire_run_lease(store, "outage-run", ttl_s=3600, wait_s=0)
    lease.stop_heartbeat()
    assert lease.record is not None
    token, lines = lease.record.token, []
    proxy.answer_error(
        lambda request: request.method == "GET" and request.path.endswith("/leases/run.json") and now[0] < 60,
        status=503,
        code="SlowDown",
        times=100,
    )
    try:
        ride_out_outage(
            lambda: check_run_lease(store, "outage-run", token, "segment 1"),
            "segment 1",
            OutageBackoff(sleep=sleep, clock=lambda: now[0]),
            warn=lines.append,
        )
        refused = [action for action, _ in proxy.applied]
        assert now[0] >= 60 and refused == ["error"] * len(refused) and 3 <= len(refused) <= 6
        assert len(lines) == len(refused) and "503" in lines[0]
    finally:
        assert lease.release()
