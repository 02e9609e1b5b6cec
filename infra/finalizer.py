"""One finalizer per run, in step order.

A publication commits only while it holds the run's finalizer lease
(`RUN_ID/leases/finalizer.json`, infra/lease.py): a second committer on the
same run waits, and one on another machine too. Among publications waiting
for it, the lowest step goes first (FIFO): a waiter yields while a committer
of an earlier step is waiting too (its journal mirror, still PREPARED, says
so with a `waiting_at` refreshed every `ttl_s / 3`). A waiter that died
stops counting `ttl_s` after its last refresh, and a publication that was
prepared but has no committer waiting does not count: neither can block the
run. A publication that already has its
outcome never comes here (a retry skips the FIFO wait).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .journal import Journal, JournalRecord, PublicationState, read_mirrors
from .lease import Lease, LeaseHeldError
from .manifests import checkpoint_name
from .storage import StoreLocation

FINALIZER_LEASE = "finalizer"


@dataclass(frozen=True)
class FinalizerSettings:
    ttl_s: float = 60.0
    """Seconds the finalizer lease outlives its holder's last heartbeat."""
    wait_s: float = 1800.0
    """How long a publication waits for the lease (and for earlier steps) before failing, retriably."""
    poll_s: float = 0.5
    owner: str | None = None
    """Who holds the lease (default host:pid)."""


class FinalizerWaitTimeout(TimeoutError):
    """Earlier steps kept the finalizer past the wait; a retry resumes the wait."""


def earlier_live_publications(store: StoreLocation, run_id: str, step: int, fresh_s: float) -> list[JournalRecord]:
    """Publications of earlier steps whose committer is waiting for the finalizer, and alive."""
    records, _ = read_mirrors(store, run_id)
    now = time.time()
    return [r for r in records if r.step < step and r.state is PublicationState.PREPARED
            and r.waiting_at is not None and now - r.waiting_at < fresh_s]


@contextmanager
def finalizer(store: StoreLocation, run_id: str, settings: FinalizerSettings, *,
              journal: Journal | None = None, purpose: str | None = None) -> Iterator[Lease]:
    """Hold the run's finalizer lease (heartbeat running).

    With the `journal` of a publication waiting to commit, in step order (FIFO);
    without one (cleanup, garbage collection), as soon as the lease is free.
    """
    in_step_order = journal is not None
    step = journal.step if journal is not None else -1
    lease = Lease.for_run(store, run_id, FINALIZER_LEASE, owner=settings.owner, ttl_s=settings.ttl_s,
                          purpose=purpose or f"finalizer of run {run_id} for {checkpoint_name(step)}")
    started, last_touch = time.monotonic(), 0.0
    while True:
        if in_step_order and time.monotonic() - last_touch > settings.ttl_s / 3:
            journal.touch_waiting()  # tells later steps that this one is alive and waiting
            last_touch = time.monotonic()
        blockers = earlier_live_publications(store, run_id, step, settings.ttl_s) if in_step_order else []
        held: LeaseHeldError | None = None
        if not blockers:
            try:
                lease.acquire(wait_s=0)
            except LeaseHeldError as error:
                held = error
            else:
                # An earlier step may have started waiting while we acquired.
                blockers = earlier_live_publications(store, run_id, step, settings.ttl_s) if in_step_order else []
                if not blockers:
                    break
                lease.release()
        waited = time.monotonic() - started
        if waited >= settings.wait_s:
            if held is not None:
                raise held
            waiting_for = ", ".join(f"{checkpoint_name(r.step)} ({r.state.value})" for r in blockers)
            raise FinalizerWaitTimeout(
                f"finalizer of run {run_id}: {checkpoint_name(step)} waited {waited:.0f} s for earlier steps to "
                f"commit first ({waiting_for}); checkpoints are published in step order — retry later, or let "
                f"those publications finish (a dead waiter stops counting {settings.ttl_s:.0f} s after its last sign of life)"
            )
        time.sleep(settings.poll_s)
    lease.start_heartbeat()
    try:
        yield lease
    finally:
        lease.release()
