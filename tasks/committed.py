"""Whether a step's checkpoint is already committed, so a scheduled tick of a finished run launches nothing.

The one place that answers it, with the publication's verifying reader at
its confirm depth (infra/publication/checkpoints.py): a checkpoint counts only when its
manifest parses, stays inside its checkpoint and every file it lists is in
the store with its size and sha256 — confirmed by a digest the store
computed from the bytes it holds (one HEAD per file on S3), or else by
hashing the file. A sha256 recorded at upload is not enough: bytes changed
under it keep it. A step whose checkpoint does not pass is published again
(export → commit), which repairs it from the stored state — unless
retention removed it after its commit (`RUN_ID/retired/`): that step is
done, and a rerun does not publish it again.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run

from infra.publication.checkpoints import verify_checkpoint
from infra.publication.commit import CommitOutcome, checkpoint_name
from infra.publication.journal import Journal, PublicationState, journal_path_for
from infra.publication.manifests import checkpoint_key
from infra.publication.retention import is_retired
from infra.runs import ledger
from infra.store import open_store
from infra.store.base import ObjectStore

from .outcomes import PlannedRun


def committed_checkpoint_url(store: ObjectStore, run_id: str, step: int) -> str | None:
    """The checkpoint of `step` when it is committed and its bytes are confirmed (see the module docstring)."""
    name = checkpoint_name(step)
    verified = verify_checkpoint(store, run_id, name, confirm=True).verified
    return store.url_of(checkpoint_key(run_id, name)) if verified else None


def _cleanup_pending(planned: PlannedRun, store: ObjectStore, segment_index: int) -> bool:
    """Whether this machine's journal of the step in this store says COMMITTED: its cleanup must run again."""
    from .export import staged_dir_for  # the export stage owns where a step is staged

    step = planned.segment_steps[segment_index][1]
    path = journal_path_for(staged_dir_for(planned, segment_index), store)
    journal = Journal(path, None, planned.run_id, step).load()  # this machine's record only, not the mirror
    return journal.state == PublicationState.COMMITTED


def already_committed_fn(planned: PlannedRun, segment_index: int) -> CommitOutcome | None:
    """The step's committed checkpoint, or None when the publication still has work to do.

    A committed step whose cleanup is pending goes through export → commit →
    cleanup again: the journal makes the first two no-ops (nothing launched,
    nothing uploaded) and the cleanup finishes.
    """
    step = planned.segment_steps[segment_index][1]
    store = open_store(planned.storage)
    url = committed_checkpoint_url(store, planned.run_id, step)
    if url is None and is_retired(store, planned.run_id, step):
        return _retired(planned, store, segment_index, step)
    if url is None or _cleanup_pending(planned, store, segment_index):
        return None
    ledger.record(
        Path(planned.run_dir),
        "export",
        "skipped",
        step=step,
        segment=segment_index,
        checkpoint_url=url,
        reason="already committed",
    )
    return _nothing_done(url, step)


def _nothing_done(url: str, step: int, notes: tuple[str, ...] = ()) -> CommitOutcome:
    """The outcome of a publication skipped because the step was committed before: nothing uploaded or moved."""
    return CommitOutcome(
        checkpoint_url=url,
        step=step,
        num_files_uploaded=0,
        num_files_skipped=0,
        bytes_uploaded=0,
        latest_moved=False,
        wall_s=0.0,
        already_committed=True,
        notes=notes,
    )


def _retired(planned: PlannedRun, store: ObjectStore, segment_index: int, step: int) -> CommitOutcome:
    """A step retention removed after its commit (storage.keep_last): published once, not exported again."""
    url = store.url_of(checkpoint_key(planned.run_id, checkpoint_name(step)))
    ledger.record(
        Path(planned.run_dir), "export", "skipped", step=step, segment=segment_index, reason="removed by retention"
    )
    return _nothing_done(url, step, ("committed earlier, then removed by retention (storage.keep_last)",))


def _run_name() -> str:
    parameters = task_run.parameters
    return f"committed-step-{parameters['planned'].segment_steps[parameters['segment_index']][1]}?"


already_committed = task(
    name="already-committed", task_run_name=_run_name, retries=2, retry_delay_seconds=[2, 5], cache_policy=NO_CACHE
)(already_committed_fn)
