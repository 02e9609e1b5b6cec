"""The export stage: a torchrun launch that stages a Hugging Face checkpoint locally.

It drives the first half of the publication's journal (infra/publication/journal.py):
PREPARING before the launch, PREPARED once the staged manifest is there, and
ABORTED (temporaries removed) when any rank fails. A publication that already
has its outcome (committed earlier: a re-run, a retried flow) is not exported
again while its checkpoint verifies in the store (the confirm check of
infra/publication/checkpoints.py); one whose checkpoint does not (bytes changed, objects
gone) is a lost outcome: a new publication of the step is exported from the
segment's stored state, and the commit repairs the store.

The journal is the one of this store (infra/runs/local_records.py): the same work
dir used with another `storage.url` exports and commits the step for that
store, never trusting the first store's outcome.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.publication.checkpoints import verify_checkpoint
from infra.publication.cleanup import abort_publication
from infra.publication.commit import checkpoint_name
from infra.publication.journal import Journal, PublicationState
from infra.publication.manifests import MANIFEST_FILE, parse_manifest
from infra.runs import ledger
from infra.runs.run_lease import RunLeaseLost
from infra.store import open_store
from trainer_core.run.plan import read_plan
from trainer_core.run.progress import export_progress_path
from trainer_core.run.records import ExportResult, export_result_path

from ._launch import launch_stage
from ._logging import rank_line_logger
from .failure_report import reports_failures
from .fencing import fence, fenced_monitor
from .outcomes import ExportOutcome, PlannedRun
from .retry_policy import retry_unless_fenced, rides_out_outages
from .run_state import fetch_plan_file, fetch_segment_state
from .watchdog import ProgressWatch


def staged_dir_for(planned: PlannedRun, segment_index: int) -> Path:
    step = planned.segment_steps[segment_index][1]
    return Path(planned.run_dir) / "export" / checkpoint_name(step)


def export_fingerprint(planned: PlannedRun, step: int) -> str:
    """What decides the exported bytes: the plan, the step and the export settings."""
    export_settings = read_plan(Path(planned.run_dir)).config.get("export", {})
    identity = json.dumps({"plan": planned.digest, "step": step, "export": export_settings}, sort_keys=True)
    return hashlib.sha256(identity.encode()).hexdigest()


def export_segment_fn(planned: PlannedRun, segment_index: int, on_line=print) -> ExportOutcome:
    run_dir = Path(planned.run_dir)
    fence(planned, f"export of segment {segment_index}")
    fetch_plan_file(planned)
    out_dir = staged_dir_for(planned, segment_index)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    step = planned.segment_steps[segment_index][1]
    store = open_store(planned.storage)
    journal = Journal.for_staging(out_dir, store, planned.run_id, step)
    fingerprint = export_fingerprint(planned, step)
    lost = None
    if journal.has_outcome and journal.record is not None and journal.record.fingerprint in (fingerprint, None):
        report = verify_checkpoint(store, planned.run_id, checkpoint_name(step), confirm=True)
        if report.verified:
            # Committed already (a re-run, a retried flow): never serialize it again.
            outcome = ExportOutcome(
                segment=segment_index,
                step=step,
                staged_dir=str(out_dir),
                reused=True,
                num_files=journal.record.num_files + 1,
                num_bytes=journal.record.num_bytes,
                launch_wall_s=0.0,
            )
            ledger.record(run_dir, "export", "reused", publication=journal.record.state.value, **outcome.model_dump())
            return outcome
        lost = f"does not verify in the store ({'; '.join(report.problems)})"
        ledger.record(run_dir, "export", "repairing", step=step, segment=segment_index, reason=lost)
    # The work dir is a cache (the state may be only in the store), and a checkpoint is published only from a
    # state the store holds: its bundle must be there, whatever this machine has.
    fetch_segment_state(planned, segment_index, stored_only=True)
    journal.begin(fingerprint, outcome_lost=lost)
    progress_file = export_progress_path(run_dir, segment_index)
    watch = ProgressWatch(
        progress_file, planned.train.stall_timeout_s
    )  # a hung rank: ended at stall_timeout_s, not the collective's
    try:
        launched = launch_stage(
            planned,
            "export",
            "trainer_core.run.export_main",
            segment_index,
            ["--out", str(out_dir)],
            on_line,
            timeout_s=planned.export.timeout_s,
            monitor=fenced_monitor(planned, f"export of segment {segment_index}", watch),
        )
    except RunLeaseLost:
        raise  # the staging belongs to the run that holds the lease now
    except Exception as error:
        # Every rank has aborted this publication; record it and drop the temporaries.
        abort_publication(out_dir, store, planned.run_id, step, reason=str(error).splitlines()[0])
        raise
    fence(planned, f"export of segment {segment_index}")
    result = ExportResult.read(export_result_path(out_dir))
    manifest_bytes = (out_dir / MANIFEST_FILE).read_bytes()
    manifest = parse_manifest(manifest_bytes, str(out_dir / MANIFEST_FILE), run_id=planned.run_id, step=result.step)
    outcome = ExportOutcome(
        segment=segment_index,
        step=result.step,
        staged_dir=str(out_dir),
        reused=result.reused,
        num_files=len(manifest.files) + 1,
        num_bytes=manifest.num_bytes,
        launch_wall_s=launched.wall_s,
    )
    journal.transition(
        PublicationState.PREPARED,
        note="export staged",
        mirror_required=False,
        manifest_sha256=hashlib.sha256(manifest_bytes).hexdigest(),
        num_files=len(manifest.files),
        num_bytes=outcome.num_bytes,
    )
    ledger.record(run_dir, "export", "completed", weights_sha256=result.weights_sha256, **outcome.model_dump())
    return outcome


@task(
    name="export",
    task_run_name="export-segment-{segment_index}",
    retries=2,
    retry_delay_seconds=[2, 10],
    retry_condition_fn=retry_unless_fenced,
    cache_policy=NO_CACHE,
)
@reports_failures("export")
@rides_out_outages("export")
def export_segment(planned: PlannedRun, segment_index: int) -> ExportOutcome:
    return export_segment_fn(planned, segment_index, on_line=rank_line_logger())
