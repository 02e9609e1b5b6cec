"""The retention stage: after a checkpoint commits, remove what `storage.keep_*` does not keep.

Fenced by the run lease like the other publication stages, holding the
finalizer lease inside (infra/publication/retention.py), retried on its own.
It runs after the commit and its cleanup, and a failure never fails or rolls
back the commit: after its retries it is a warning and a ledger line, and the
next checkpoint's retention (whose rule reads the store, not a memory of
what was done) or `rankflow checkpoints gc --config` catches up. A lost run
lease still ends the run: another run of the run id owns it now.
"""

from __future__ import annotations

import logging
from pathlib import Path

from infra.publication.commit import CommitOutcome
from infra.publication.finalizer import FinalizerSettings
from infra.publication.retention import RetentionPolicy, RetentionReport, SegmentStates, apply_retention
from infra.runs.run_lease import RunAlreadyActive, RunLeaseLost
from infra.store import open_store
from trainer_core.run.state import state_dir_for

from .outcomes import PlannedRun
from .retry_policy import retry_unless_final
from .stage import Stage, stage_task

log = logging.getLogger(__name__)


def segment_states(planned: PlannedRun, step: int) -> SegmentStates:
    """What state retention needs of the plan, with the segment that ends at `step` as the anchor."""
    run_dir = Path(planned.run_dir)
    anchor = next(index for index, (_, end) in enumerate(planned.segment_steps) if end == step)
    return SegmentStates(
        anchor=anchor,
        exported=lambda j: planned.export.after_segment(j, planned.num_segments),
        end_step=lambda j: planned.segment_steps[j][1],
        state_prefix=lambda j: state_dir_for(run_dir, j).relative_to(run_dir).as_posix(),
        run_dir=run_dir,
    )


def retain_fn(planned: PlannedRun, committed: CommitOutcome) -> RetentionReport:
    attempt = Stage.enter(planned, "retention", f"retention after step {committed.step}")
    report = apply_retention(
        open_store(planned.storage),
        planned.run_id,
        RetentionPolicy.of(planned.storage),
        # Fenced inside too: the finalizer checks the run lease before each removal.
        FinalizerSettings(run_lease_token=planned.lease_token),
        segment_states(planned, committed.step),
    )
    attempt.record("completed", step=committed.step, **report.to_dict())
    return report


# An outage is not ridden out within the attempt: a failed retention is a warning, the next one catches up.
retain = stage_task(
    "retention",
    run_name="retention-after-step-{committed.step}",
    retries=2,
    retry_delay_seconds=[2, 10],
    retry_condition_fn=retry_unless_final,
    rides_out=False,
)(retain_fn)


def apply_retention_after(planned: PlannedRun, committed: CommitOutcome) -> RetentionReport | None:
    """Run the retention stage; its failure (after retries) is a warning, never the commit's failure."""
    state = retain(planned, committed, return_state=True)
    if state.is_completed():
        return state.result()
    error = state.result(raise_on_failure=False)
    if isinstance(error, (RunLeaseLost, RunAlreadyActive)):
        raise error
    log.warning(
        "retention after step %s failed (%s); checkpoint %s stays committed, the next retention or "
        "`rankflow checkpoints gc --config` removes what it should have",
        committed.step,
        error,
        committed.checkpoint_url,
    )
    return None
