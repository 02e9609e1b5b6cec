"""The storage check before training: the store is reachable and writable, or the run stops in seconds.

Not retried: a wrong endpoint or bucket will not fix itself, and nothing has
been trained yet, so running the same config again later costs nothing.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra import ledger
from infra.preflight import check_store_writable

from .failure_report import report_failure
from .outcomes import PlannedRun


def check_storage_fn(planned: PlannedRun) -> dict:
    run_dir = Path(planned.run_dir)
    try:
        figures = check_store_writable(planned.storage_url, planned.run_id)
    except Exception as error:
        report_failure(run_dir, planned.run_id, "storage-check", error)
        raise
    ledger.record(run_dir, "storage-check", "completed", **figures)
    return figures


check_storage = task(name="storage-check", cache_policy=NO_CACHE)(check_storage_fn)
