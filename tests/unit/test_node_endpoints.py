"""How the nodes of an attempt find node 0 without a pinned endpoint, and how a node queue without a worker is found.

The rendezvous notice goes through a real local store; the queue check reads
a stand-in for Prefect's client (the PostgreSQL tier checks it against a
real server with live workers: tests/e2e/nodes/test_work_pool_nodes.py).
"""

from __future__ import annotations

import datetime
import threading
import time
from types import SimpleNamespace

import pytest

from infra.launch.rendezvous_board import publish_endpoint, read_endpoint, withdraw_endpoint
from infra.store import open_store
from tasks.nodes.queue_liveness import QUEUE_SILENCE_S, silent_queue_problem

RUN = "run-0123456789ab"


def test_the_others_wait_for_node_zeros_notice_and_read_its_endpoint(tmp_path):
    store = open_store(str(tmp_path / "store"))
    rdzv = f"{RUN}-segment-0001-attempt-A"
    publisher = threading.Timer(0.3, publish_endpoint, args=(store, RUN, rdzv, "10.0.0.5:29411"))
    publisher.start()
    started = time.monotonic()
    assert read_endpoint(store, RUN, rdzv, timeout_s=10) == "10.0.0.5:29411"
    assert time.monotonic() - started >= 0.25  # it waited for the notice rather than failing at once
    assert (tmp_path / "store" / RUN / "rendezvous" / f"{rdzv}.json").is_file()
    withdraw_endpoint(store, RUN, rdzv)
    assert not (tmp_path / "store" / RUN / "rendezvous" / f"{rdzv}.json").exists()


def test_a_failed_attempts_notice_is_never_read_by_the_retry(tmp_path):
    store = open_store(str(tmp_path / "store"))
    publish_endpoint(store, RUN, f"{RUN}-segment-0001-attempt-A", "10.0.0.5:29411")  # left by a failed attempt
    now = [0.0]
    with pytest.raises(TimeoutError, match=r"did not publish its rendezvous endpoint for .*attempt-B within 5 s"):
        read_endpoint(
            store,
            RUN,
            f"{RUN}-segment-0001-attempt-B",
            timeout_s=5,
            clock=lambda: now[0],
            sleep=lambda s: now.__setitem__(0, now[0] + s),
        )


def test_a_notice_stored_under_another_attempts_key_is_refused(tmp_path):
    store = open_store(str(tmp_path / "store"))
    publish_endpoint(store, RUN, f"{RUN}-segment-0001-attempt-A", "10.0.0.5:29411")
    copied = tmp_path / "store" / RUN / "rendezvous"
    (copied / f"{RUN}-segment-0001-attempt-B.json").write_bytes(
        (copied / f"{RUN}-segment-0001-attempt-A.json").read_bytes()
    )
    with pytest.raises(ValueError, match="attempt-A.* stored as .*attempt-B"):
        read_endpoint(store, RUN, f"{RUN}-segment-0001-attempt-B", timeout_s=1)


def test_a_reader_stops_waiting_when_a_sibling_failed(tmp_path):
    store = open_store(str(tmp_path / "store"))
    with pytest.raises(RuntimeError, match="another node of the segment failed"):
        read_endpoint(store, RUN, "r", timeout_s=60, stop=lambda: "another node of the segment failed")


NOW = datetime.datetime(2026, 12, 4, 12, 0, tzinfo=datetime.timezone.utc)


class _Client:
    """Prefect's client as the queue check reads it: queues by name, the pool's workers."""

    def __init__(self, queues: dict, workers: list) -> None:
        self.queues, self.workers = queues, workers

    def read_work_queue_by_name(self, name, work_pool_name):
        from prefect.exceptions import ObjectNotFound

        assert work_pool_name == "gpu"
        if name not in self.queues:
            raise ObjectNotFound(http_exc=Exception(name))
        return SimpleNamespace(last_polled=self.queues[name])

    def read_workers_for_work_pool(self, pool):
        return self.workers


def _ago(seconds: float) -> datetime.datetime:
    return NOW - datetime.timedelta(seconds=seconds)


def test_a_queue_polled_recently_is_served_and_a_silent_one_is_named_with_the_fix():
    workers = [
        SimpleNamespace(name="worker-a", last_heartbeat_time=_ago(5), heartbeat_interval_seconds=30),
        SimpleNamespace(name="worker-dead", last_heartbeat_time=_ago(600), heartbeat_interval_seconds=30),
    ]
    client = _Client({"node-0": _ago(3), "node-1": _ago(QUEUE_SILENCE_S + 1), "node-2": None}, workers)
    assert silent_queue_problem(client, "gpu", "node-0", now=NOW) is None
    assert silent_queue_problem(client, "gpu", "node-1", now=_ago(2)) is None  # 1 s younger: still served
    stale = silent_queue_problem(client, "gpu", "node-1", now=NOW)
    assert stale is not None and "work queue 'node-1' of pool 'gpu': it was last polled 46 s ago" in stale
    assert "(workers online in the pool: worker-a)" in stale
    assert "prefect worker start --pool gpu --work-queue node-1" in stale
    assert "it was never polled" in (silent_queue_problem(client, "gpu", "node-2", now=NOW) or "")
    assert "it does not exist" in (silent_queue_problem(client, "gpu", "node-3", now=NOW) or "")
