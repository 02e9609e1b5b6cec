"""The run lease: one run of a run id at a time, and fencing of every write a run makes.

The run id is the plan's digest, so two runs of one config (two scheduled
ticks, a manual run beside a scheduled one) share a run directory and a store
prefix. The first to take the lease `RUN_ID/leases/run.json` (infra/store/lease.py:
owner, heartbeat, generation) runs; a second one waits up to
`run.lease_wait_s` and then stops with `RunAlreadyActive`, whose one-line
message names the run id, the holder (owner, host, pid), its last heartbeat and
what to do. Nothing is written before the lease is held: the plan is computed
(a pure function) to learn the run id, and only then written.

A holder that dies is taken over at once when it ran on this machine (its
process is gone), otherwise `run.lease_ttl_s` after its last heartbeat, so a
crashed run never wedges the next one for longer than that.

Fencing: every writing stage calls `check_run_lease` with the lease token its
run acquired; a run whose lease was taken over (another token in the store) or
released gets `RunLeaseLost` and writes nothing more. A lease that expired
unrenewed but still carries this run's token (its heartbeat starved or paused,
nobody took it over) is still this run's: the check renews it, with a write
conditional on the version it read, as `Lease.check()` does, so only a real
takeover stops the run. The check reads the lease object from the store, so it
holds wherever the stage runs. Inside a commit, a cleanup or a state upload the
finalizer checks it again before each write that makes an outcome (the
manifest, LATEST, a bundle manifest, the journal) and after each data file
(`FinalizerSettings.run_lease_token`, infra/publication/finalizer.py), so a run paused or
cut off past its ttl in the middle of one stops there when it resumes.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from infra.store.base import ObjectStore
from infra.store.lease import (
    Lease,
    LeaseHeldError,
    LeaseLostError,
    LeaseRecord,
    lease_key,
    read_lease_renewed,
)

RUN_LEASE = "run"
"""The lease's name: `RUN_ID/leases/run.json` in the store."""


def run_lease_path(store: ObjectStore, run_id: str) -> str:
    return store.path(lease_key(run_id, RUN_LEASE))


def describe_holder(holder: LeaseRecord | None, now: float | None = None) -> str:
    """`OWNER (host H, pid P), last heartbeat N s ago, lease expires in M s (ttl T s)`."""
    if holder is None:
        return "a holder whose lease object is unreadable"
    now = time.time() if now is None else now
    age_s = max(0.0, now - holder.renewed_at)
    left_s = holder.expires_at - now
    expiry = f"expires in {left_s:.0f} s" if left_s > 0 else f"expired {-left_s:.0f} s ago"
    return (
        f"{holder.owner} (host {holder.host or '?'}, pid {holder.pid or '?'}), last heartbeat {age_s:.0f} s ago, "
        f"lease {expiry} (ttl {holder.ttl_s:g} s, generation {holder.generation})"
    )


class RunAlreadyActive(RuntimeError):
    """Another run of the same run id holds the run lease: this one did nothing and stopped."""

    def __init__(self, message: str, run_id: str) -> None:
        super().__init__(message)
        self.run_id = run_id

    def __reduce__(self):  # Prefect may pickle the exception with the flow run's final state
        return type(self), (str(self), self.run_id)


class RunLeaseLost(LeaseLostError):
    """This run's lease expired or was taken over by another run: stop without writing."""

    stage = "run-lease"


def already_active(run_id: str, holder: LeaseRecord | None, waited_s: float, path: str) -> RunAlreadyActive:
    ttl = f"{holder.ttl_s:g}" if holder else "run.lease_ttl_s"
    return RunAlreadyActive(
        f"run {run_id} is already running: its run lease {path} is held by {describe_holder(holder)}; "
        f"waited {waited_s:.0f} s (run.lease_wait_s). Nothing was done. Let that run finish, or set run.lease_wait_s "
        f"to wait for it; if it is stuck, stop it: a holder that died on this machine is taken over at once, "
        f"any other {ttl} s after its last heartbeat",
        run_id,
    )


def acquire_run_lease(
    store: ObjectStore,
    run_id: str,
    *,
    ttl_s: float,
    wait_s: float,
    owner: str | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> Lease:
    """Take the run lease (waiting up to `wait_s`) and start its heartbeat; raises RunAlreadyActive.

    `on_wait` hears one line when the lease is held and this run starts waiting for it.
    """
    lease = Lease.for_run(store, run_id, RUN_LEASE, owner=owner, ttl_s=ttl_s, purpose=f"run lease of run {run_id}")
    started = time.monotonic()
    try:
        with store.errors(f"run lease of run {run_id}"):
            try:
                lease.acquire(wait_s=0)
            except LeaseHeldError as held:
                if wait_s <= 0:
                    raise
                if on_wait is not None:
                    on_wait(
                        f"run {run_id} is already running, held by {describe_holder(held.holder)}; "
                        f"waiting up to {wait_s:g} s (run.lease_wait_s) for its run lease"
                    )
                lease.acquire(wait_s=wait_s)
    except LeaseHeldError as held:
        raise already_active(run_id, held.holder, time.monotonic() - started, held.path) from None
    lease.start_heartbeat()
    return lease


def check_run_lease(store: ObjectStore, run_id: str, token: str, stage: str) -> None:
    """Fencing: raise RunLeaseLost unless the run holding lease `token` still holds it (renewed if it had lapsed).

    A lapsed lease that still carries `token` but whose renewal the store did not take (the conditional write
    refused, nothing else written) raises ConnectionError: a storage outage, retried, never a loss."""
    path = run_lease_path(store, run_id)
    with store.errors(f"run lease of run {run_id}"):
        # Expired unrenewed (its heartbeat starved or paused) but nobody took it over: still ours, renewed.
        holder = read_lease_renewed(store, path, token)
    if holder is not None and holder.token == token and not holder.expired(time.time()):
        return
    if holder is not None and holder.token == token:
        # Still ours, lapsed, and our conditional renewal lost with nothing else written (the record read back is
        # the one it was to replace): no takeover, the store did not take the write. An outage: retried.
        raise ConnectionError(
            f"{stage} of run {run_id} stopped before writing: its run lease {path} in {store.url} still names this "
            f"run (expired unrenewed {time.time() - holder.expires_at:.0f} s ago, nobody took it over), but the "
            "renewal could not be written there (the store refused the conditional write, and nothing else was "
            "written); retried while the store recovers"
        )
    why = "was released or removed" if holder is None else f"was taken over by {describe_holder(holder)}"
    raise RunLeaseLost(
        f"{stage} of run {run_id} stopped before writing: this run's lease {why}. Another run of the same run id "
        f"owns it now; this run wrote nothing more (on {socket.gethostname()})"
    )
