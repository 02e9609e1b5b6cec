"""The commit and cleanup stages: publish a staged checkpoint, then tidy up.

Both are retried on their own. A failed cleanup never rolls back the commit
before it, and a retried commit skips the objects an earlier try uploaded.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra import ledger
from infra.publication import cleanup_staging, commit_checkpoint
from infra.storage import open_store

from .outcomes import CommitRecord, ExportOutcome, PlannedRun


def commit_fn(planned: PlannedRun, exported: ExportOutcome) -> CommitRecord:
    run_dir = Path(planned.run_dir)
    try:
        outcome = commit_checkpoint(Path(exported.staged_dir), open_store(planned.storage_url), planned.run_id)
    except Exception as error:
        ledger.record(run_dir, "commit", "failed", step=exported.step, error=f"{type(error).__name__}: {error}")
        raise
    ledger.record(run_dir, "commit", "completed", **outcome.to_dict())
    return CommitRecord(**outcome.to_dict())


def cleanup_fn(planned: PlannedRun, exported: ExportOutcome) -> dict:
    run_dir = Path(planned.run_dir)
    try:
        result = cleanup_staging(Path(exported.staged_dir), open_store(planned.storage_url), planned.run_id)
    except Exception as error:
        ledger.record(run_dir, "cleanup", "failed", step=exported.step, error=f"{type(error).__name__}: {error}")
        raise
    ledger.record(run_dir, "cleanup", "completed", step=exported.step, **result)
    return result


commit = task(name="commit", task_run_name="commit-step-{exported.step}", retries=3,
              retry_delay_seconds=[2, 5, 15], cache_policy=NO_CACHE)(commit_fn)
cleanup = task(name="cleanup", task_run_name="cleanup-step-{exported.step}", retries=3,
               retry_delay_seconds=[2, 5, 15], cache_policy=NO_CACHE)(cleanup_fn)
