"""The commit and cleanup stages: publish a staged checkpoint, then tidy up.

Both are retried on their own and resume from the publication's journal: a
failed cleanup never rolls back the commit before it, a retried commit skips
the objects an earlier try uploaded (confirmed in the store), and one whose
staging no longer matches its manifest (or is gone), or whose committed
checkpoint no longer verifies in the store, exports the step again from its
stored state and commits that instead (`EXPORT_AGAIN`). A failure a retry
cannot change (bad input, a refused transition) is not retried; each failure
is reported under its stage's name.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from infra.publication.cleanup import CleanupOutcome, cleanup_staging
from infra.publication.commit import EXPORT_AGAIN, CommitOutcome, PublishSettings, commit_checkpoint
from infra.store import open_store

from ._logging import rank_line_logger
from .export import export_segment_fn
from .fencing import fenced_settings
from .outcomes import ExportOutcome, PlannedRun
from .retry_policy import retry_unless_final
from .stage import Stage, stage_task


class _Recorded(Protocol):
    def to_dict(self) -> dict: ...


T = TypeVar("T", bound=_Recorded)


def _recorded(
    planned: PlannedRun,
    exported: ExportOutcome,
    stage: str,
    action: Callable[..., T],
    handled: tuple[type[Exception], ...] = (),
) -> T:
    """Run one publication stage and record its outcome in the ledger (a failed attempt: `reports_failures`).

    An error in `handled` is the caller's to resolve: recorded as resolved by it, not reported as a failure."""
    attempt = Stage.enter(planned, stage, f"{stage} of step {exported.step}")

    def resolved_by_the_caller(error: Exception) -> None:
        error_line = f"{type(error).__name__}: {error}"
        attempt.record("failed", step=exported.step, error=error_line, resolved_by="export again")

    with attempt.on_failure(resolved_by_the_caller, errors=handled):
        outcome = action(
            Path(exported.staged_dir),
            open_store(planned.storage),
            planned.run_id,
            settings=fenced_settings(planned, PublishSettings),
        )
    attempt.record("completed", **outcome.to_dict())
    return outcome


def commit_fn(planned: PlannedRun, exported: ExportOutcome) -> CommitOutcome:
    try:
        return _recorded(planned, exported, "commit", commit_checkpoint, handled=EXPORT_AGAIN)
    except EXPORT_AGAIN:
        # The staged files changed after the export (disk fault, a stray
        # writer), or are gone, or the store lost the committed bytes:
        # serialize the step again from its stored state and commit that.
        export_segment_fn(planned, exported.segment, on_line=_line_logger())
        return _recorded(planned, exported, "commit", commit_checkpoint)


def _line_logger() -> Callable[[str], None]:
    try:
        return rank_line_logger()
    except Exception:  # noqa: BLE001 - outside a Prefect run (task.fn() in tests): print
        return print


def cleanup_fn(planned: PlannedRun, exported: ExportOutcome) -> CleanupOutcome:
    return _recorded(planned, exported, "cleanup", cleanup_staging)


def _publication_task(stage: str, function: Callable[[PlannedRun, ExportOutcome], object]):
    """The commit or cleanup task: each retried on its own, by the same rule (`retry_unless_final`)."""
    return stage_task(
        stage,
        run_name=stage + "-step-{exported.step}",
        retries=3,
        retry_delay_seconds=[2, 5, 15],
        retry_condition_fn=retry_unless_final,
    )(function)


commit = _publication_task("commit", commit_fn)
cleanup = _publication_task("cleanup", cleanup_fn)
