"""The commit and cleanup stages: publish a staged checkpoint, then tidy up.

Both are retried on their own. A failed cleanup never rolls back the commit
before it, and a retried commit skips the objects an earlier try uploaded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra import ledger
from infra.publication import CommitOutcome, cleanup_staging, commit_checkpoint
from infra.storage import open_store

from .outcomes import ExportOutcome, PlannedRun

T = TypeVar("T")


def _recorded(planned: PlannedRun, exported: ExportOutcome, stage: str, action: Callable[..., T]) -> T:
    """Run one publication stage and record its outcome (or its error) in the ledger."""
    run_dir = Path(planned.run_dir)
    try:
        outcome = action(Path(exported.staged_dir), open_store(planned.storage_url), planned.run_id)
    except Exception as error:
        ledger.record(run_dir, stage, "failed", step=exported.step, error=f"{type(error).__name__}: {error}")
        raise
    figures = outcome.to_dict() if isinstance(outcome, CommitOutcome) else {"step": exported.step, **outcome}
    ledger.record(run_dir, stage, "completed", **figures)
    return outcome


def commit_fn(planned: PlannedRun, exported: ExportOutcome) -> CommitOutcome:
    return _recorded(planned, exported, "commit", commit_checkpoint)


def cleanup_fn(planned: PlannedRun, exported: ExportOutcome) -> dict:
    return _recorded(planned, exported, "cleanup", cleanup_staging)


commit = task(name="commit", task_run_name="commit-step-{exported.step}", retries=3,
              retry_delay_seconds=[2, 5, 15], cache_policy=NO_CACHE)(commit_fn)
cleanup = task(name="cleanup", task_run_name="cleanup-step-{exported.step}", retries=3,
               retry_delay_seconds=[2, 5, 15], cache_policy=NO_CACHE)(cleanup_fn)
