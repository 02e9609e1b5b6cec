"""The run lease's own logic (infra/runs/run_lease.py, tasks/fencing.py) on a local store and on S3.

The holder message names the run, the holder and what to do; the fence passes
only for the holder of the current lease; a launch monitor ends on a stolen
lease; computing the plan writes nothing for the run, and the lease settings do
not change the run id.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from infra.runs.run_lease import RunAlreadyActive, RunLeaseLost, acquire_run_lease, check_run_lease, run_lease_path
from infra.store import open_store
from infra.store.lease import read_lease
from tasks.fencing import fence, fenced_monitor
from tasks.outcomes import PlannedRun
from tasks.plan import compute_plan_fn
from tests.conftest import tiny_tree
from tests.e2e.run_lease.runs import steal
from trainer_core.config import StorageSection, TrainSection, config_from_dict

RUN = "lease-test-0123456789ab"


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store(request, tmp_path):
    if request.param == "local":
        return open_store(str(tmp_path / "store"))
    request.getfixturevalue("s3_env")
    return open_store(request.getfixturevalue("s3_bucket_url"))


def test_a_second_run_gets_one_message_naming_the_run_the_holder_and_what_to_do(store):
    first = acquire_run_lease(store, RUN, ttl_s=30, wait_s=0, owner=None)
    try:
        started = time.monotonic()
        with pytest.raises(RunAlreadyActive) as caught:
            acquire_run_lease(store, RUN, ttl_s=30, wait_s=1.0)
        assert time.monotonic() - started >= 1.0  # it waited run.lease_wait_s before giving up
        message = str(caught.value)
        assert "\n" not in message and caught.value.run_id == RUN
        assert message.startswith(f"run {RUN} is already running: ")
        assert f"{socket.gethostname()}:" in message and f"pid {first.record.pid}" in message
        assert "last heartbeat " in message and " s ago" in message and "ttl 30 s" in message
        assert "set run.lease_wait_s" in message and "Nothing was done" in message
    finally:
        first.release()
    acquire_run_lease(store, RUN, ttl_s=30, wait_s=0).release()  # released: free for the next run


def test_a_waiting_run_takes_the_lease_once_the_holder_releases_it(store):
    first = acquire_run_lease(store, RUN, ttl_s=30, wait_s=0)
    generation, holder_gone = first.record.generation, time.time() + 1.5
    threading.Timer(1.5, first.release).start()
    second = acquire_run_lease(store, RUN, ttl_s=30, wait_s=30)
    assert time.time() >= holder_gone and second.record.generation == generation + 1
    second.release()


def test_the_fence_passes_only_for_the_current_holder(store):
    lease = acquire_run_lease(store, RUN, ttl_s=30, wait_s=0)
    token = lease.record.token
    check_run_lease(store, RUN, token, "segment 0")
    thief = steal(store, RUN)
    with pytest.raises(
        RunLeaseLost,
        match=rf"segment 0 of run {RUN} stopped before writing: .*taken over by "
        rf"gpu-node-9:4242 \(host gpu-node-9, pid 4242\)",
    ):
        check_run_lease(store, RUN, token, "segment 0")
    assert not lease.release()  # the loser never overwrites the new holder's lease
    assert read_lease(store, run_lease_path(store, RUN)) == thief


def test_the_fence_fails_on_a_released_lease_and_renews_one_that_lapsed_untaken(store):
    lease = acquire_run_lease(store, RUN, ttl_s=30, wait_s=0)
    token = lease.record.token
    lease.release()
    with pytest.raises(RunLeaseLost, match="was released"):
        check_run_lease(store, RUN, token, "commit")
    path = run_lease_path(store, RUN)
    lapsed = acquire_run_lease(store, RUN, ttl_s=30, wait_s=0)
    lapsed.stop_heartbeat()  # as if paused: nobody renews it
    assert lapsed.record is not None
    record = lapsed.record.model_copy(update={"expires_at": time.time() - 1})
    store.fs.pipe_file(path, record.to_bytes())
    check_run_lease(store, RUN, record.token, "cleanup")  # before: RunLeaseLost, "expired unrenewed"
    renewed = read_lease(store, path)
    assert renewed is not None and (renewed.token, renewed.generation) == (record.token, record.generation)
    assert renewed.expires_at > time.time() + 20  # renewed for its ttl (30 s)
    assert lapsed.release()  # the holder's own release still settles on its token (the tag it saw is stale)


def _planned(store_url: str, token: str | None, tmp_path) -> PlannedRun:
    return PlannedRun(
        run_id=RUN,
        digest="d",
        run_dir=str(tmp_path / "work" / RUN),
        segment_steps=[(0, 3)],
        train=TrainSection(segment_timeout_s=60),
        storage=StorageSection(url=store_url),
        lease_token=token,
    )


def test_a_launch_monitor_raises_once_the_lease_is_stolen(tmp_path):
    store = open_store(str(tmp_path / "store"))
    lease = acquire_run_lease(store, RUN, ttl_s=30, wait_s=0)
    planned = _planned(store.url, lease.record.token, tmp_path)
    now = [0.0]
    calls = []
    watch = fenced_monitor(planned, "segment 0", lambda: calls.append(1), every_s=2.0, clock=lambda: now[0])
    now[0] = 2.5
    assert watch() is None and calls == [1]  # held: the inner monitor runs
    steal(store, RUN)
    now[0] = 3.0
    assert watch() is None  # checked only every 2 s: one small read per interval
    now[0] = 5.0
    with pytest.raises(RunLeaseLost):
        watch()
    fence(_planned(store.url, None, tmp_path), "segment 0")  # no lease taken (stages driven directly): not fenced
    lease.stop_heartbeat()


def test_computing_the_plan_writes_nothing_for_the_run_and_lease_keys_keep_the_run_id(tmp_path):
    config = config_from_dict(tiny_tree(tmp_path), config_dir=tmp_path)
    computed = compute_plan_fn(config)
    assert not (tmp_path / "work" / computed.run_id).exists() and not (tmp_path / "store").exists()
    other = config_from_dict(tiny_tree(tmp_path, run={"lease_wait_s": 120, "lease_ttl_s": 5}), config_dir=tmp_path)
    assert compute_plan_fn(other).run_id == computed.run_id


def test_a_stage_fenced_off_by_the_run_lease_is_never_retried():
    from prefect.states import Failed

    from tasks.retry_policy import retry_if_retriable, retry_unless_fenced

    lost = RunLeaseLost("segment 0 of run r stopped before writing: this run's lease was taken over")
    busy = RunAlreadyActive("run r is already running", "r")
    outage = ConnectionError("object storage at s3://b is unreachable")
    for policy in (retry_if_retriable, retry_unless_fenced):
        assert not policy(None, None, Failed(data=lost)) and not policy(None, None, Failed(data=busy))
        assert policy(None, None, Failed(data=outage))  # what the policy retried before still is
