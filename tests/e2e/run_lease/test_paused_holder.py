"""A run whose heartbeat stopped past its ttl, with no other run of its run id, is not fenced off (issue 31, item 6).

A holder process takes the run lease (ttl 1.5 s, heartbeat every 0.5 s) and is
stopped with SIGSTOP, heartbeat included, as a starved or paused machine is;
its lease expires unrenewed in the store. A stage of that run (its fence,
here in this process, as a Prefect task on a worker would run it) renews it:
the record keeps the run's token and generation, and the holder, resumed,
renews on and releases it as its own. Only a real takeover is `lease_lost`.
Reference: the lease record in the store.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.runs.run_lease import RunLeaseLost, check_run_lease, run_lease_path
from infra.store import open_store
from infra.store.lease import Lease, LeaseRecord
from tests.e2e.run_lease.runs import wait_for

RUN = "paused-holder-0123456789ab"
TTL_S = 1.5
REPO = Path(__file__).resolve().parents[3]

HOLDER = """
import sys
from infra.runs.run_lease import acquire_run_lease
from infra.store import open_store
lease = acquire_run_lease(open_store(sys.argv[1]), sys.argv[2], ttl_s=float(sys.argv[3]), wait_s=0)
print(lease.record.token, flush=True)
sys.stdin.read()  # holds (heartbeat running) until the test closes its stdin
print("released" if lease.release() else "lost", flush=True)
"""


def _record(store, path: str) -> LeaseRecord:
    return LeaseRecord.from_bytes(store.fs.cat_file(path))


@pytest.fixture
def paused(tmp_path):
    """A holder of the run lease, stopped (SIGSTOP) until its lease expired unrenewed: (store, path, token, process)."""
    store = open_store(str(tmp_path / "store"))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, store.url, RUN, str(TTL_S)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        token = holder.stdout.readline().strip()
        assert token, "the holder took no lease"
        path = run_lease_path(store, RUN)
        os.kill(holder.pid, signal.SIGSTOP)
        wait_for(lambda: _record(store, path).expired(time.time()), 120, "the paused holder's lease to expire")
        yield store, path, token, holder
    finally:
        if holder.poll() is None:  # a test that failed before resuming it
            os.kill(holder.pid, signal.SIGCONT)
            holder.kill()
            holder.wait(timeout=60)


def _resume_and_release(holder: subprocess.Popen) -> str:
    os.kill(holder.pid, signal.SIGCONT)
    out, _ = holder.communicate("", timeout=120)
    assert holder.returncode == 0
    return out.strip()


def test_the_fence_renews_a_lease_that_expired_unrenewed_while_its_holder_was_paused(paused):
    store, path, token, holder = paused
    lapsed = _record(store, path)
    check_run_lease(store, RUN, token, "state upload of segment 1")  # before: RunLeaseLost, "expired unrenewed"
    renewed = _record(store, path)
    assert (renewed.token, renewed.generation, renewed.released) == (token, lapsed.generation, False)
    assert renewed.renewed_at > lapsed.renewed_at and not renewed.expired(renewed.renewed_at + TTL_S / 2)
    # The holder, resumed, finds its lease renewed under a version it never saw, and keeps and releases it as its own.
    assert _resume_and_release(holder) == "released"
    final = _record(store, path)
    assert (final.token, final.generation, final.released) == (token, lapsed.generation, True)


def test_a_real_takeover_of_a_paused_holder_is_still_lease_lost(paused):
    store, path, token, holder = paused
    thief = Lease.for_run(store, RUN, "run", owner="thief-on-node-2", ttl_s=600).acquire()
    assert thief.record is not None and thief.record.generation == _record(store, path).generation
    with pytest.raises(RunLeaseLost, match="was taken over by thief-on-node-2"):
        check_run_lease(store, RUN, token, "state upload of segment 1")
    assert _record(store, path).token == thief.record.token  # the fence wrote nothing over the new holder
    assert _resume_and_release(holder) == "lost"
    assert _record(store, path).token == thief.record.token
    assert thief.release()
