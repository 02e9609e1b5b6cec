"""A lease write whose answer was lost is not a takeover (infra/store/conditional.py, infra/store/lease.py).

The store applied the write; only its answer never came back. Two ways that
reaches the caller, both injected here on a local store by wrapping the write
primitive: the client retried the same request, which the store refused
because the first one had already changed the object (S3's 412 to a retried
conditional PUT), or the client gave up with a connection error. Either way,
the bytes in the store are this holder's own: the reference every test reads.
A genuine takeover (another holder's token in the store) is still a loss.
"""

from __future__ import annotations

import time

import pytest

import infra.store.conditional as conditional
import infra.store.lease as lease_module
import infra.store.local as local_store
from infra.publication.finalizer import FinalizerSettings, finalizer
from infra.runs.run_lease import acquire_run_lease, run_lease_path
from infra.store import open_store
from infra.store.lease import Lease, LeaseLostError, LeaseRecord

RUN = "lost-answer-run"


@pytest.fixture
def store(tmp_path):
    return open_store(str(tmp_path / "store"))


def stored(store, path: str) -> LeaseRecord:
    return LeaseRecord.from_bytes(store.fs.cat_file(path))


def retried_after_lost_answer(monkeypatch, name: str, times: int = 1) -> list[str]:
    """Make the lease's next `times` calls of conditional write `name` land, lose their answer, and be retried.

    The retry is the same conditional request again, which the store refuses:
    the first one already changed the object.
    """
    real = getattr(conditional, name)
    lost: list[str] = []

    def applied_then_retried(store, path, data, *tag):
        if len(lost) >= times:
            return real(store, path, data, *tag)
        lost.append(path)
        real(store, path, data, *tag)  # the store applied it; its answer was lost on the way back
        return real(store, path, data, *tag)  # the client's retry of the same request

    monkeypatch.setattr(lease_module, name, applied_then_retried)
    return lost


def applied_then_cut_off(monkeypatch, name: str, times: int = 1) -> list[str]:
    """Make the lease's next `times` calls of conditional write `name` land, then fail with a connection error."""
    real = getattr(conditional, name)
    lost: list[str] = []

    def applied_then_raised(store, path, data, *tag):
        if len(lost) >= times:
            return real(store, path, data, *tag)
        lost.append(path)
        real(store, path, data, *tag)
        raise ConnectionResetError(f"answer to the write of {path} lost: connection reset by peer")

    monkeypatch.setattr(lease_module, name, applied_then_raised)
    return lost


def cut_off_after_write(monkeypatch, name: str) -> None:
    """The next write `name` lands, then the store is unreachable for it and for the read that would confirm it."""
    applied_then_cut_off(monkeypatch, name)
    real_read = lease_module.read_versioned
    failures = [ConnectionRefusedError("object storage unreachable")]

    def read_after_the_cut(store, path):
        if failures:
            raise failures.pop()
        return real_read(store, path)

    monkeypatch.setattr(lease_module, "read_versioned", read_after_the_cut)


# -- the conditional write itself ------------------------------------------------


def test_a_create_retried_after_its_answer_was_lost_returns_the_tag_of_its_bytes(store, monkeypatch):
    path = store.path(RUN, "object.json")
    real = local_store.create_exclusive

    def retried(target, data):
        real(target, data)  # applied; the answer lost
        return real(target, data)  # the retry finds the object there: refused

    monkeypatch.setattr(local_store, "create_exclusive", retried)
    tag = conditional.create_if_absent(store, path, b'{"nonce": "mine"}')
    assert tag is not None and tag == conditional.read_versioned(store, path).tag
    assert conditional.create_if_absent(store, path, b'{"nonce": "someone else"}') is None  # a real conflict


def test_a_replace_whose_answer_was_lost_returns_the_tag_of_its_bytes(store, monkeypatch):
    path = store.path(RUN, "object.json")
    first = conditional.create_if_absent(store, path, b'{"nonce": 1}')
    real = local_store.write_durable

    def applied_then_raised(target, data):
        real(target, data)
        raise ConnectionResetError("connection reset by peer")

    monkeypatch.setattr(local_store, "write_durable", applied_then_raised)
    tag = conditional.replace_if_unchanged(store, path, b'{"nonce": 2}', first)
    assert tag == conditional.read_versioned(store, path).tag and store.fs.cat_file(path) == b'{"nonce": 2}'
    monkeypatch.setattr(local_store, "write_durable", real)
    assert conditional.replace_if_unchanged(store, path, b'{"nonce": 3}', first) is None  # a stale tag still loses


# -- renewals ------------------------------------------------------------------


@pytest.mark.parametrize("lose", [retried_after_lost_answer, applied_then_cut_off])
def test_a_renewal_whose_answer_was_lost_keeps_the_lease(store, monkeypatch, lose):
    """Before: LeaseLostError ('expired and was taken over') for the retried one, a connection error for the other."""
    lease = Lease.for_run(store, RUN, "finalizer", ttl_s=30).acquire()
    token = lease.record.token
    lost = lose(monkeypatch, "replace_if_unchanged")
    lease.renew()
    assert lost == [lease.path] and lease.held
    record = stored(store, lease.path)
    assert record.token == token and record == lease.record  # the store holds this renewal, not another holder's
    lease.renew()
    lease.check()
    assert lease.release() and stored(store, lease.path).released


def test_a_renewal_whose_answer_was_lost_and_not_confirmed_is_recognised_by_its_token(store, monkeypatch):
    """The renewal landed, the holder saw a connection error (as its heartbeat does) and kept its old tag."""
    lease = Lease.for_run(store, RUN, "finalizer", ttl_s=30).acquire()
    token, before = lease.record.token, lease.record.expires_at
    cut_off_after_write(monkeypatch, "replace_if_unchanged")
    time.sleep(0.01)
    with pytest.raises(ConnectionResetError):
        lease.renew()  # the heartbeat treats this as an outage and tries again later
    assert stored(store, lease.path).expires_at > before  # but the renewal is in the store
    lease.check()  # the store holds this holder's token: still held
    lease.renew()  # and the next renewal replaces the record that is really there
    record = stored(store, lease.path)
    assert record.token == token and record == lease.record
    assert lease.release() and stored(store, lease.path).released


def test_a_genuine_takeover_is_still_a_loss_after_a_lost_answer(store, monkeypatch):
    lease = Lease.for_run(store, RUN, "finalizer", ttl_s=30).acquire()
    cut_off_after_write(monkeypatch, "replace_if_unchanged")
    with pytest.raises(ConnectionResetError):
        lease.renew()
    thief = Lease.for_run(store, RUN, "finalizer", owner="thief", ttl_s=30, clock=lambda: time.time() + 3600)
    thief.acquire()  # sees this holder's lease long expired and takes it over
    with pytest.raises(LeaseLostError, match="taken over"):
        lease.check()
    with pytest.raises(LeaseLostError):
        lease.renew()
    assert not lease.release() and stored(store, lease.path).owner == "thief"


def test_a_release_whose_answer_was_lost_is_released(store, monkeypatch):
    lease = Lease.for_run(store, RUN, "finalizer", ttl_s=30).acquire()
    retried_after_lost_answer(monkeypatch, "replace_if_unchanged")
    assert lease.release()
    assert stored(store, lease.path).released


# -- first acquisitions ----------------------------------------------------------


@pytest.mark.parametrize("lose", [retried_after_lost_answer, applied_then_cut_off])
def test_a_first_run_lease_write_whose_answer_was_lost_holds_the_lease(store, monkeypatch, lose):
    """Before: the run exited 75, 'already running', against its own lease (or failed as a storage outage)."""
    lost = lose(monkeypatch, "create_if_absent")
    lease = acquire_run_lease(store, RUN, ttl_s=30, wait_s=0)
    try:
        assert lost == [run_lease_path(store, RUN)]
        record = stored(store, lease.path)
        assert record == lease.record and record.generation == 1  # its own write, not a second one over it
    finally:
        lease.release()


@pytest.mark.parametrize("lose", [retried_after_lost_answer, applied_then_cut_off])
def test_a_takeover_write_whose_answer_was_lost_holds_the_lease(store, monkeypatch, lose):
    Lease.for_run(store, RUN, "run", owner="earlier", ttl_s=30).acquire().release()  # free, generation 1
    lost = lose(monkeypatch, "replace_if_unchanged")
    lease = Lease.for_run(store, RUN, "run", ttl_s=30).acquire(wait_s=0)
    assert lost and stored(store, lease.path) == lease.record and lease.record.generation == 2
    lease.release()


def test_a_finalizer_write_whose_answer_was_lost_holds_the_lease_at_once(store, monkeypatch):
    lost = retried_after_lost_answer(monkeypatch, "create_if_absent")
    settings = FinalizerSettings(ttl_s=30, wait_s=600, poll_s=600.0)  # one poll would outlast any load
    started = time.monotonic()
    with finalizer(store, RUN, settings, step=3) as held:
        waited_s = time.monotonic() - started
        record = stored(store, held.path)
        assert lost and record.token == held.record.token and record.generation == 1
    assert waited_s < settings.poll_s  # it did not poll for a holder that was itself


# -- a lapse the store never saw taken over --------------------------------------


def test_a_lease_that_lapsed_unrenewed_and_was_not_taken_over_is_renewed_by_check(store):
    """Paused (no heartbeat) past its ttl, nobody took it: the store still holds this holder's token."""
    lease = Lease.for_run(store, RUN, "finalizer", ttl_s=0.5).acquire()
    time.sleep(0.7)
    assert stored(store, lease.path).expired(time.time())
    lease.check()  # before: LeaseLostError, "expired unrenewed"
    record = stored(store, lease.path)
    assert record.token == lease.record.token and not record.expired(time.time())
    assert lease.release()


def test_a_heartbeat_cut_off_past_the_ttl_keeps_the_lease_nobody_took(store, monkeypatch):
    lease = Lease.for_run(store, RUN, "finalizer", ttl_s=0.6, heartbeat_s=0.1).acquire()
    real = conditional.replace_if_unchanged
    cut_off = [True]

    def unreachable(store_, path, data, tag):
        if cut_off[0]:
            raise ConnectionRefusedError("object storage unreachable")
        return real(store_, path, data, tag)

    monkeypatch.setattr(lease_module, "replace_if_unchanged", unreachable)
    lease.start_heartbeat()
    time.sleep(1.0)  # every renewal fails, past the ttl
    assert stored(store, lease.path).expired(time.time())
    cut_off[0] = False
    time.sleep(0.4)  # the store answers again: the heartbeat, still running, renews
    assert not stored(store, lease.path).expired(time.time())  # before: the heartbeat had given up (lost)
    lease.check()
    assert lease.release()


def test_a_fence_whose_renewal_the_store_refused_with_nothing_else_written_is_an_outage(store, monkeypatch):
    """The run lease lapsed untaken; the fence's conditional renewal lost though the record is still this run's.

    Before: RunLeaseLost, "Another run of the same run id owns it now" (false: nobody wrote it), never retried.
    """
    from infra.launch.failures import FailureClass, classify_exception
    from infra.runs.run_lease import RunLeaseLost, check_run_lease

    lease = acquire_run_lease(store, RUN, ttl_s=30, wait_s=0)
    lease.stop_heartbeat()  # as if starved: nobody renews it
    path = run_lease_path(store, RUN)
    lapsed = lease.record.model_copy(update={"expires_at": time.time() - 1})
    store.fs.pipe_file(path, lapsed.to_bytes())
    refused: list[str] = []

    def refused_with_nothing_written(store_, path_, data, tag):
        refused.append(path_)
        return None  # "it changed": the conditional write lost, and nothing was written

    monkeypatch.setattr(lease_module, "replace_if_unchanged", refused_with_nothing_written)
    with pytest.raises(ConnectionError) as caught:
        check_run_lease(store, RUN, lapsed.token, "state upload of segment 1")
    message = str(caught.value)
    assert refused == [path] and not isinstance(caught.value, RunLeaseLost)
    assert store.url in message and "renewal could not be written" in message and "owns it now" not in message
    assert classify_exception(caught.value) is FailureClass.STORAGE_OUTAGE and FailureClass.STORAGE_OUTAGE.retriable
    assert stored(store, path) == lapsed  # the fence wrote nothing
    monkeypatch.undo()  # the store takes writes again: the next check renews the lease, still this run's
    check_run_lease(store, RUN, lapsed.token, "state upload of segment 1")
    assert not stored(store, path).expired(time.time()) and stored(store, path).token == lapsed.token
    assert lease.release()
