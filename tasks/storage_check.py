"""The storage check, first of all: the store is reachable and writable, or the run stops in seconds.

It runs before the plan, so a bad storage setting leaves nothing behind (exit
2, see `infra.store.preflight`). Not retried: a wrong endpoint or bucket will not fix
itself, and nothing has been done yet, so running the same config again later
costs nothing.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.store.writable import check_store_writable

check_storage = task(name="storage-check", task_run_name="storage-check", cache_policy=NO_CACHE)(check_store_writable)
