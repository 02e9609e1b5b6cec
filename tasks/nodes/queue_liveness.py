"""Is a live worker serving a node's work queue? Read from the workers' polls and heartbeats in the Prefect API.

A worker polls its queues every `PREFECT_WORKER_QUERY_SECONDS` (default 10 s),
and the server records each poll as the queue's `last_polled`; a worker started
with `--work-queue node-K` polls only that queue. A queue polled within
`QUEUE_SILENCE_S` has a live worker; one never polled, polled longer ago, or
missing has none, and the node run waiting on it would never start. The
workers' own heartbeats (`read_workers_for_work_pool`) name who is online in
the message, since a worker record does not say which queues it serves.
"""

from __future__ import annotations

import datetime

__all__ = ["QUEUE_SILENCE_S", "silent_queue_problem"]

QUEUE_SILENCE_S = 45.0
"""A queue not polled for this long has no live worker (4.5 polls at the default interval; a node run waiting on it
fails the attempt within a minute)."""


def _online_workers(client, pool: str, now: datetime.datetime) -> list[str]:
    online = []
    for worker in client.read_workers_for_work_pool(pool):
        beat = worker.last_heartbeat_time
        interval = worker.heartbeat_interval_seconds or 30
        if beat is not None and (now - beat).total_seconds() <= 2 * interval:
            online.append(worker.name)
    return sorted(online)


def silent_queue_problem(
    client, pool: str, queue: str, *, silence_s: float = QUEUE_SILENCE_S, now: datetime.datetime | None = None
) -> str | None:
    """Why no live worker serves `queue` of `pool` (a sentence naming both and the fix), or None when one does."""
    from prefect.exceptions import ObjectNotFound

    now = now or datetime.datetime.now(datetime.timezone.utc)
    try:
        polled = client.read_work_queue_by_name(queue, work_pool_name=pool).last_polled
    except ObjectNotFound:
        polled, seen = None, "does not exist"
    else:
        seen = "was never polled" if polled is None else f"was last polled {(now - polled).total_seconds():.0f} s ago"
    if polled is not None and (now - polled).total_seconds() <= silence_s:
        return None
    online = _online_workers(client, pool, now)
    return (
        f"no live worker serves work queue {queue!r} of pool {pool!r}: it {seen} (workers online in the pool: "
        f"{', '.join(online) or 'none'}); start `prefect worker start --pool {pool} --work-queue {queue}` on that "
        "node's machine"
    )
