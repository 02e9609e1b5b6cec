"""Whether a step's checkpoint is already committed, so a scheduled tick of a finished run launches nothing.

The one place that answers it: the publication work's verifying reader can
replace `committed_checkpoint_url` without touching the flow.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run

from infra import ledger
from infra.checkpoints import is_complete
from infra.publication import CommitOutcome, checkpoint_name
from infra.storage import open_store

from .outcomes import PlannedRun


def committed_checkpoint_url(storage_url: str, run_id: str, step: int) -> str | None:
    """The checkpoint of `step` when its manifest is in the store and every file it lists is there."""
    store = open_store(storage_url)
    name = checkpoint_name(step)
    return store.url_of(run_id, "checkpoints", name) if is_complete(store, run_id, name) else None


def already_committed_fn(planned: PlannedRun, segment_index: int) -> CommitOutcome | None:
    step = planned.segment_steps[segment_index][1]
    url = committed_checkpoint_url(planned.storage_url, planned.run_id, step)
    if url is None:
        return None
    ledger.record(Path(planned.run_dir), "export", "skipped", step=step, segment=segment_index, checkpoint_url=url,
                  reason="already committed")
    return CommitOutcome(checkpoint_url=url, step=step, num_files_uploaded=0, num_files_skipped=0,
                         bytes_uploaded=0, latest_moved=False, wall_s=0.0)


def _run_name() -> str:
    parameters = task_run.parameters
    return f"committed-step-{parameters['planned'].segment_steps[parameters['segment_index']][1]}?"


already_committed = task(name="already-committed", task_run_name=_run_name, retries=2, retry_delay_seconds=[2, 5], cache_policy=NO_CACHE)(already_committed_fn)
