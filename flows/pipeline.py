"""The training pipeline as a Prefect flow: plan → segments → export → commit → cleanup → retention → report.

Each segment's state upload (tasks/state_upload.py) runs beside the next segment; the flow waits for the
uploads before a checkpoint is published and before the report.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.client.schemas.objects import State
from prefect.runtime import flow_run

from infra.launch.warm_ranks import warm_ranks
from infra.publication.commit import CommitOutcome
from infra.publication.parent import resolve_parent
from infra.tracking import tag_checkpoint
from tasks.committed import already_committed
from tasks.events import CHECKPOINT_COMMITTED, emit_run_event, flow_run_url
from tasks.export import export_segment
from tasks.live import create_live_artifacts, show_steps_done
from tasks.outcomes import PlannedRun
from tasks.plan import compute_plan, write_plan_task
from tasks.publish import cleanup, commit
from tasks.report import report
from tasks.retention import apply_retention_after
from tasks.segment import train_segment
from tasks.state_upload import StateUploads
from tasks.storage_check import check_storage
from trainer_core.config import RunConfig

from .run_record import RunFailed, RunRecord

__all__ = ["RunFailed", "train_flow"]


def _planning_name() -> str:
    """The flow run's name until the plan names the run (the run id is the plan's digest)."""
    config = flow_run.parameters["config"]
    name = config.run.name if isinstance(config, RunConfig) else config["run"]["name"]
    return f"{name} (planning)"


@flow(name="rankflow-train", flow_run_name=_planning_name, log_prints=True)
def train_flow(config: RunConfig) -> dict | State:
    """Train `config` in segments, exporting and committing checkpoints as configured."""
    run = RunRecord(config)
    with run.failures_reported(), warm_ranks():  # `rankflow run` started it already; a deployed run starts it here
        check_storage(config.storage.url)
        resolve_parent(config)  # model.path naming a committed checkpoint (a deployed run; `rankflow run` did it)
        computed = compute_plan(config)  # pure: names the run (its id), writes nothing for it
        planned = run.planned(write_plan_task(config, computed, lease_token=run.leased(computed)))
        live = create_live_artifacts(planned.run_id, planned.total_steps, steps_done=0)
        with run.uploads(StateUploads(planned)) as uploads:  # a held upload is let go however the flow leaves
            previous = None
            for index in range(planned.num_segments):
                previous = train_segment(
                    planned, index, live, wait_for=[previous] if previous else None, return_state=True
                )
                run.segments.append(previous.result())
                uploads.after(index)  # the state to the store, beside the next segment (one upload at a time)
                show_steps_done(live, run.segments[-1].end_step)
                if config.export_after_segment(index):
                    uploads.wait()  # a checkpoint is published only from states the store holds
                    run.commits.append(publish_checkpoint(run, planned, index))
            uploads.wait()  # nothing is reported before every state is stored
        run.files = report(planned, run.segments, run.commits)
    return run.outcome()  # the summary; Cancelled when another run of the run id holds its lease


def publish_checkpoint(run: RunRecord, planned: PlannedRun, index: int) -> CommitOutcome:
    """export → commit → cleanup of segment `index`'s state, unless its checkpoint is already committed."""
    committed = already_committed(planned, index)
    if committed is not None:
        return committed
    staged = run.exported(export_segment(planned, index))
    committed = commit(planned, staged)
    cleanup(planned, staged)
    apply_retention_after(planned, committed)  # storage.keep_*: never fails or rolls back the commit
    tag_checkpoint(planned, committed.checkpoint_url, warn=get_run_logger().warning)  # an outage: a warning
    emit_run_event(
        CHECKPOINT_COMMITTED,
        planned.run_id,
        loss=run.segments[-1].losses[-1],
        step=committed.step,
        url=committed.checkpoint_url,
        flow_run_url=flow_run_url(),
    )
    return committed
