"""A lost lease is never a code error (infra/launch/failures.py, tasks/retry_policy.py).

A lost run lease is `lease_lost`, never retried; a lost finalizer lease alone
is `finalizer_lost`, retried (the run lease still holds, so the next try takes
the finalizer again).

Before: `LeaseLostError` is a RuntimeError, which the classifier took for a
bug (`code_error`): a state upload whose finalizer lease was taken over
reported a code error. Reference: a real takeover of the finalizer lease by
another holder while a state upload is in flight, and the error it raises.
"""

from __future__ import annotations

import time

import pytest
from prefect.states import Failed

from infra.launch.failures import classify_error, classify_exception
from infra.runs.run_lease import RunLeaseLost
from infra.runs.run_state import manifest_path, publish_bundle
from infra.store import open_store
from infra.store.lease import Lease, LeaseHeldError, LeaseLostError
from tasks.failure_report import failure_of
from tasks.retry_policy import retry_if_retriable, retry_unless_fenced, retry_unless_final

RUN = "lease-class-run"


def test_a_state_upload_whose_finalizer_was_taken_over_fails_as_finalizer_lost_and_is_retried(tmp_path):
    store = open_store(str(tmp_path / "store"))
    run_dir = tmp_path / "work"
    for index in range(3):
        (run_dir / "state" / "segment-0000" / f"part-{index}.bin").parent.mkdir(parents=True, exist_ok=True)
        (run_dir / "state" / "segment-0000" / f"part-{index}.bin").write_bytes(bytes([index]) * 1000)
    thief = Lease.for_run(store, RUN, "finalizer", owner="gc-on-node-2", ttl_s=60, clock=lambda: time.time() + 3600)

    def take_over_after_the_first_upload(event: str) -> None:
        if event.startswith("uploaded ") and thief.record is None:
            thief.acquire()  # sees the uploader's lease expired (its clock is an hour ahead) and takes it over

    with pytest.raises(LeaseLostError) as caught:
        publish_bundle(
            store,
            RUN,
            run_dir,
            "segment-0000",
            [f"state/segment-0000/part-{i}.bin" for i in range(3)],
            observer=take_over_after_the_first_upload,
        )
    assert thief.record is not None and not store.fs.exists(manifest_path(store, RUN, "segment-0000"))
    error = caught.value
    assert classify_exception(error).value == "finalizer_lost"  # before: "code_error"
    assert classify_exception(error).retriable
    failure = failure_of("segment", error)
    assert failure.cause.value == "finalizer_lost" and "a retry can help" in failure.headline()
    for policy in (retry_if_retriable, retry_unless_fenced, retry_unless_final):
        assert policy(None, None, Failed(data=error))


def test_every_lease_error_has_its_own_class():
    lost = LeaseLostError("finalizer of run r: the lease x of a:1 was taken over; stop and retry")
    run_lost = RunLeaseLost("commit of run r stopped before writing: this run's lease was taken over")
    held = LeaseHeldError("r/leases/finalizer.json", None, 30.0, "finalizer of run r")
    assert classify_exception(run_lost).value == "lease_lost" and not classify_exception(run_lost).retriable
    assert classify_exception(lost).value == "finalizer_lost" and classify_exception(lost).retriable
    assert classify_error("LeaseLostError", str(lost)).value == "finalizer_lost"  # as a rank reports it
    for policy in (retry_if_retriable, retry_unless_fenced, retry_unless_final):
        assert not policy(None, None, Failed(data=run_lost))
    assert classify_error("RunLeaseLost", str(run_lost)).value == "lease_lost"
    # Waiting for a finalizer another committer holds is worth a retry (it resumes the wait).
    assert classify_exception(held).retriable and retry_unless_fenced(None, None, Failed(data=held))
    assert retry_if_retriable(None, None, Failed(data=held))
