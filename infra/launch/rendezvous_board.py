"""Node 0 publishes its rendezvous endpoint through the run's store; the other nodes of the attempt read it.

With `train.rdzv_endpoint` unset, node 0's launch picks a free port on its own
address, writes `RendezvousNotice` to

    RUN_ID/rendezvous/RDZV_ID.json

and starts its torchrun (which serves the c10d store there); every other node
polls that key until it appears and joins. The key is the attempt's
rendezvous id (`infra.launch.rendezvous.rendezvous_id`), so a notice left by a
failed attempt is never read by a retry, and the notice names that id again:
one stored under another key is refused. Node 0 publishes before its store
listens; the readers' torchrun keeps connecting to it for c10d's read timeout
(60 s), far more than the seconds between the notice and the listening store.
The store works the same for the local nodes and for a work pool's node flow
runs, and needs nothing but what the run already uses; node 0 removes the
notice when its launch ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict

from infra.store.base import ObjectStore

from .rendezvous import JOIN_TIMEOUT_S

__all__ = ["RendezvousNotice", "publish_endpoint", "read_endpoint", "withdraw_endpoint"]

POLL_S = 0.5


class RendezvousNotice(BaseModel):
    """Where node 0 serves the rendezvous of one attempt."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rdzv_id: str
    endpoint: str
    """HOST:PORT of node 0's c10d store."""


def _key(store: ObjectStore, run_id: str, rdzv_id: str) -> str:
    return store.key(run_id, "rendezvous", f"{rdzv_id}.json")


def publish_endpoint(store: ObjectStore, run_id: str, rdzv_id: str, endpoint: str) -> None:
    notice = RendezvousNotice(rdzv_id=rdzv_id, endpoint=endpoint)
    with store.errors(f"publishing the rendezvous endpoint of {rdzv_id}"):
        store.put(_key(store, run_id, rdzv_id), notice.model_dump_json().encode())


def withdraw_endpoint(store: ObjectStore, run_id: str, rdzv_id: str) -> None:
    with store.errors(f"removing the rendezvous endpoint of {rdzv_id}"):
        store.remove([_key(store, run_id, rdzv_id)])


def read_endpoint(
    store: ObjectStore,
    run_id: str,
    rdzv_id: str,
    *,
    timeout_s: float = JOIN_TIMEOUT_S,
    stop: Callable[[], str | None] = lambda: None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Node 0's endpoint for attempt `rdzv_id`, waiting for its notice up to `timeout_s` (or until `stop` says why)."""
    key = _key(store, run_id, rdzv_id)
    deadline = clock() + timeout_s
    while True:
        with store.errors(f"reading the rendezvous endpoint of {rdzv_id}"):
            found = store.get(key)
        if found is not None:
            notice = RendezvousNotice.model_validate_json(found.data)
            if notice.rdzv_id != rdzv_id:
                raise ValueError(
                    f"{store.url_of(run_id, 'rendezvous')}: a notice for {notice.rdzv_id!r} stored as {rdzv_id!r}"
                )
            return notice.endpoint
        reason = stop()
        if reason is not None:
            raise RuntimeError(f"stopped waiting for node 0's rendezvous endpoint of {rdzv_id}: {reason}")
        if clock() > deadline:
            raise TimeoutError(
                f"node 0 did not publish its rendezvous endpoint for {rdzv_id} within {timeout_s:g} s "
                f"({store.url_of(run_id, 'rendezvous', rdzv_id + '.json')}); is a worker serving work queue node-0, "
                "or pin train.rdzv_endpoint?"
            )
        sleep(POLL_S)
