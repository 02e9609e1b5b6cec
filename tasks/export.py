"""The export stage: a torchrun launch that stages a Hugging Face checkpoint locally.

It drives the first half of the publication's journal through
infra/publication/export_journal.py: a step already committed whose
checkpoint verifies in the store is not exported again (a re-run, a retried
flow); one whose checkpoint does not is exported again from the segment's
stored state (a lost outcome: the commit repairs the store). Otherwise the
journal is PREPARING before the launch, PREPARED once the staged manifest is
there, and ABORTED (temporaries removed) when any rank fails.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from infra.publication.commit import checkpoint_name
from infra.publication.export_journal import ExportJournal
from infra.store import open_store
from trainer_core.run.plan import read_plan
from trainer_core.run.progress import export_progress_path
from trainer_core.run.records import ExportResult, export_result_path

from ._launch import launch_stage
from ._logging import rank_line_logger
from .fencing import fenced_monitor
from .outcomes import ExportOutcome, PlannedRun
from .retry_policy import retry_unless_fenced
from .run_state import fetch_plan_file, fetch_segment_state
from .stage import Stage, stage_task
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
    attempt = Stage.enter(planned, "export", f"export of segment {segment_index}")
    fetch_plan_file(planned)
    out_dir = staged_dir_for(planned, segment_index)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    step = planned.segment_steps[segment_index][1]
    journal = ExportJournal(
        out_dir, open_store(planned.storage), planned.run_id, step, export_fingerprint(planned, step)
    )
    committed = journal.verified_outcome()
    if committed is not None:  # committed already (a re-run, a retried flow): never serialize it again
        outcome = ExportOutcome(
            segment=segment_index,
            step=step,
            staged_dir=str(out_dir),
            reused=True,
            num_files=committed.num_files + 1,
            num_bytes=committed.num_bytes,
            launch_wall_s=0.0,
        )
        attempt.record("reused", publication=committed.state.value, **outcome.model_dump())
        return outcome
    if journal.outcome_lost is not None:
        attempt.record("repairing", step=step, segment=segment_index, reason=journal.outcome_lost)
    # The work dir is a cache (the state may be only in the store), and a checkpoint is published only from a
    # state the store holds: its bundle must be there, whatever this machine has.
    fetch_segment_state(planned, segment_index, stored_only=True)
    journal.begin()
    # A hung rank: ended at stall_timeout_s, not the collective's.
    watch = ProgressWatch(export_progress_path(Path(planned.run_dir), segment_index), planned.train.stall_timeout_s)
    with attempt.on_failure(journal.abort):  # every rank has aborted this publication
        launched = launch_stage(
            planned,
            "export",
            "trainer_core.run.export_main",
            segment_index,
            ["--out", str(out_dir)],
            on_line,
            timeout_s=planned.export.timeout_s,
            monitor=fenced_monitor(planned, attempt.what, watch),
        )
    attempt.fence()
    result = ExportResult.read(export_result_path(out_dir))
    manifest = journal.prepared(result.step)
    outcome = ExportOutcome(
        segment=segment_index,
        step=result.step,
        staged_dir=str(out_dir),
        reused=result.reused,
        num_files=len(manifest.files) + 1,
        num_bytes=manifest.num_bytes,
        launch_wall_s=launched.wall_s,
    )
    attempt.record("completed", weights_sha256=result.weights_sha256, **outcome.model_dump())
    return outcome


@stage_task(
    "export",
    run_name="export-segment-{segment_index}",
    retries=2,
    retry_delay_seconds=[2, 10],
    retry_condition_fn=retry_unless_fenced,
)
def export_segment(planned: PlannedRun, segment_index: int) -> ExportOutcome:
    return export_segment_fn(planned, segment_index, on_line=rank_line_logger())
