"""One finalizer per run, in step order.

A publication commits only while it holds the run's finalizer lease
(`RUN_ID/leases/finalizer.json`, infra/store/lease.py): a second committer on the
same run waits, and one on another machine too. Among committers waiting for
it, the lowest step goes first (FIFO): a committer that has to wait says so
with a small object `RUN_ID/finalizer-queue/step-N.json` (refreshed every
`ttl_s / 3`, removed once it holds the lease), and a holder yields the lease
while an earlier step's waiter is alive. A waiter that died stops counting
`ttl_s` after its last refresh, so it cannot block the run. A publication that
already has its outcome never comes here (a retry skips the FIFO wait).

The finalizer also fences the writer's run: given the run lease the writer's
run holds (`FinalizerSettings.run_lease_token`), it checks that lease once it
holds the finalizer, before each queue refresh, and in every `check()` of the
held section (infra/runs/run_lease.py). Publication calls `check()` right before
each write that makes an outcome (the manifest, LATEST, a bundle manifest, the
journal) and after each data file, so a run whose lease was taken over while it
was inside (paused past its ttl, cut off) writes nothing more from there on.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from infra.publication.manifests import checkpoint_name, queue_dir_key, queue_key, step_of
from infra.runs.run_lease import check_run_lease
from infra.store.base import ObjectStore
from infra.store.lease import Lease, LeaseHeldError, LeaseRecord
from infra.store.objects import put_small

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
    run_lease_token: str | None = None
    """The run lease the writer's run holds (None: not fenced, e.g. `rankflow checkpoints gc`); checked with
    the finalizer lease, so a run whose lease was taken over publishes nothing more."""


@dataclass(frozen=True)
class HeldFinalizer:
    """The finalizer lease, held; `check()` fences a write against it and against the writer's run lease."""

    lease: Lease
    fence_run: Callable[[], None]

    @property
    def owner(self) -> str:
        return self.lease.owner

    @property
    def path(self) -> str:
        return self.lease.path

    @property
    def record(self) -> LeaseRecord | None:
        return self.lease.record

    def check(self) -> None:
        """Raise LeaseLostError (RunLeaseLost for the run lease) unless both leases are still this writer's."""
        self.lease.check()
        self.fence_run()


def _run_fence(store: ObjectStore, run_id: str, token: str | None, purpose: str) -> Callable[[], None]:
    if token is None:
        return lambda: None
    return lambda: check_run_lease(store, run_id, token, purpose)


class FinalizerWaitTimeout(TimeoutError):
    """Earlier steps kept the finalizer past the wait; a retry resumes the wait."""


class QueueEntry(BaseModel):
    """`finalizer-queue/step-N.json`: a committer waiting for the finalizer, and since when (its sign of life)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    waiting_at: Annotated[float, Field(allow_inf_nan=False)]
    owner: str

    def to_bytes(self) -> bytes:
        # The bytes of every entry written before this model (field order, default separators).
        return json.dumps(self.model_dump()).encode()


def _queue_path(store: ObjectStore, run_id: str, step: int) -> str:
    return store.path(queue_key(run_id, step))


def earlier_waiters(store: ObjectStore, run_id: str, step: int, fresh_s: float) -> list[int]:
    """Steps before `step` whose committer is waiting for the finalizer, and alive (one listing, usually empty)."""
    with store.errors(f"finalizer queue of run {run_id}"):
        names = [name.removesuffix(".json") for name in store.children(queue_dir_key(run_id))]
        earlier = sorted(s for s in map(step_of, names) if s is not None and s < step)
        alive = []
        for other in earlier:
            try:
                entry = store.get(store.key_of(_queue_path(store, run_id, other)))
                if entry is None:
                    raise FileNotFoundError
                waiting_at = QueueEntry.model_validate(json.loads(entry.data)).waiting_at
            except (FileNotFoundError, ValueError, TypeError):
                continue  # gone meanwhile, or unreadable: not a live waiter
            if time.time() - waiting_at < fresh_s:
                alive.append(other)
        return alive


@contextmanager
def finalizer(
    store: ObjectStore, run_id: str, settings: FinalizerSettings, *, step: int | None = None, purpose: str | None = None
) -> Iterator[HeldFinalizer]:
    """Hold the run's finalizer lease (heartbeat running), fenced by the writer's run lease if given.

    For the publication of `step`, in step order (FIFO); without a step
    (cleanup, garbage collection), as soon as the lease is free.
    """
    purpose = purpose or f"finalizer of run {run_id} for {checkpoint_name(step or 0)}"
    lease = Lease.for_run(store, run_id, FINALIZER_LEASE, owner=settings.owner, ttl_s=settings.ttl_s, purpose=purpose)
    fence_run = _run_fence(store, run_id, settings.run_lease_token, purpose)
    started, last_touch = time.monotonic(), None
    while True:
        blockers: list[int] = []
        held: LeaseHeldError | None = None
        try:
            lease.acquire(wait_s=0)
        except LeaseHeldError as error:
            held = error
        else:
            # Holding the lease, yield it to an earlier step whose committer is waiting too.
            blockers = earlier_waiters(store, run_id, step, settings.ttl_s) if step is not None else []
            if not blockers:
                break
            lease.release()
        waited = time.monotonic() - started
        if waited >= settings.wait_s:
            if held is not None:
                raise held
            assert step is not None  # without a step, a free lease ends the wait (no earlier waiters)
            raise FinalizerWaitTimeout(
                f"finalizer of run {run_id}: {checkpoint_name(step)} waited {waited:.0f} s for earlier steps "
                f"({', '.join(map(checkpoint_name, blockers))}) to commit first; checkpoints are published in "
                f"step order — retry later (a dead waiter stops counting {settings.ttl_s:.0f} s after its last "
                "sign of life)"
            )
        if step is not None and (last_touch is None or time.monotonic() - last_touch > settings.ttl_s / 3):
            fence_run()  # a run that lost its lease while it waited does not queue on
            with store.errors(f"finalizer queue of run {run_id}"):
                put_small(
                    store,
                    _queue_path(store, run_id, step),
                    QueueEntry(waiting_at=time.time(), owner=lease.owner).to_bytes(),
                )
            last_touch = time.monotonic()
        time.sleep(settings.poll_s)
    try:
        if step is not None and last_touch is not None:  # this committer queued (it has a step): leave the queue
            with store.errors(f"finalizer queue of run {run_id}"):
                store.remove([store.key_of(_queue_path(store, run_id, step))])
        lease.start_heartbeat()
        fence_run()  # the run lease may have been lost while this writer waited for the finalizer
        yield HeldFinalizer(lease, fence_run)
    finally:
        # An unreachable store must not replace the error that ended the work
        # (usually the same outage) with one about the release: an unreleased
        # lease is taken over at once by a retry in this process, or expires.
        with contextlib.suppress(OSError):
            lease.release()
