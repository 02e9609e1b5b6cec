"""What a flow run has done so far, its summary, and the one place where a run's failure is reported.

`RunRecord.failures_reported()` wraps the pipeline from plan to cleanup: a
failure anywhere ends as `RunFailed`, whose summary keeps the run id (known
once the plan is computed, before anything of the run is written), the steps
done and the losses so far, after a `rankflow.run.failed` event and a failure
report. Each failed attempt of a stage is reported by its task
(`tasks.failure_report.reports_failures`), with the stage, rank, cause and
whether it is retried; the flow reports only what failed in its own code
(taking the run lease, say), as not retried: nothing retries a flow run. The
message of `RunFailed` is that failure's headline and where its full error
and traceback were written. The run
lease (infra/runs/run_lease.py) is taken by `leased` once the plan names the run,
before anything is written for it, and released on the way out, success or
failure. A run that finds its run id held by another run ends as Cancelled
(`outcome`), having done nothing; one that loses its lease midway writes nothing
more, not even its failure into the other run's ledger. The run's tracking record
(MLflow) is marked FINISHED, FAILED or KILLED on the way out, except after a lost
lease (the record is the new holder's).

Figures describe this flow run: training time, tokens and tokens/s count only
the segments it trained (reused ones took no time now), so a resumed run
reports its own speed and `launch_overhead_s` is never negative.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

from prefect.client.schemas.objects import State

from infra.launch.failures import Failure
from infra.publication.commit import CommitOutcome
from infra.runs import ledger
from infra.runs.run_lease import RunAlreadyActive, RunLeaseLost, acquire_run_lease
from infra.store import open_store
from infra.store.lease import Lease
from infra.tracking import end_tracked_run
from infra.tracking.backend import RunEnd
from tasks.events import RUN_FAILED, emit_run_event, flow_run_url
from tasks.failure_report import report_failure, reported
from tasks.live import in_prefect_run
from tasks.outcomes import ExportOutcome, PlannedRun, SegmentOutcome
from tasks.plan import ComputedPlan
from tasks.state_upload import StateUploads
from trainer_core.config import RunConfig
from trainer_core.errors import BadInputError
from trainer_core.run.plan import run_dir_for

from .run_name import rename_flow_run


class RunFailed(RuntimeError):
    """The run failed; `summary` is its summary so far (run id, steps done, losses, the failure)."""

    def __init__(self, message: str, summary: dict) -> None:
        super().__init__(message)
        self.summary = summary


class RunRecord:
    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.started = time.perf_counter()
        self.started_at = time.time()
        self.planned_run: PlannedRun | None = None
        self.segments: list[SegmentOutcome] = []
        self.commits: list[CommitOutcome] = []
        self.export_wall_s = 0.0
        self.state_uploads: StateUploads | None = None
        self.files: dict[str, str] = {}
        self.lease: Lease | None = None
        self.already_active: RunAlreadyActive | None = None
        self.run_id: str | None = None
        """The run id, from the computed plan: the summary names the run even when a later stage fails."""

    def leased(self, computed: ComputedPlan) -> str:
        """Take the run lease of the planned run id (waiting up to run.lease_wait_s); returns its token."""
        run = self.config.run
        self.run_id = computed.run_id
        self._name_flow_run(computed.run_id)
        lease = acquire_run_lease(
            open_store(self.config.storage),
            computed.run_id,
            ttl_s=run.lease_ttl_s,
            wait_s=run.lease_wait_s,
            on_wait=print,
        )
        self.lease = lease
        record = lease.record
        assert record is not None  # acquire_run_lease returns the lease acquired, which holds its record
        return record.token

    def outcome(self) -> dict | State:
        """The flow's return value: the summary, or a Cancelled state when another run held the run id."""
        if self.already_active is None:
            return self.summary("completed")
        from prefect.states import Cancelled

        return Cancelled(message=str(self.already_active), data=self.already_active)

    def planned(self, planned: PlannedRun) -> PlannedRun:
        """Keep the plan (the flow run already carries the run id's name, see `leased`)."""
        self.planned_run = planned
        return planned

    @staticmethod
    def _name_flow_run(run_id: str) -> None:
        """Name the flow run after the run id, known once the plan is computed (also when it ends Cancelled)."""
        rename_flow_run(run_id)

    def uploads(self, uploads: StateUploads) -> StateUploads:
        """Keep the run's state uploads: the summary says how long the flow waited for them."""
        self.state_uploads = uploads
        return uploads

    def exported(self, staged: ExportOutcome) -> ExportOutcome:
        self.export_wall_s += staged.launch_wall_s
        return staged

    def summary(self, status: str) -> dict:
        trained = [s for s in self.segments if not s.reused]
        train_s = sum(s.train_s for s in trained)
        tokens = sum(s.num_tokens for s in trained)
        return {
            "run_id": self.planned_run.run_id if self.planned_run else self.run_id,
            "status": status,
            "checkpoint_url": self.commits[-1].checkpoint_url if self.commits else None,
            "steps": self.segments[-1].end_step if self.segments else 0,
            "losses": [loss for s in self.segments for loss in s.losses],
            "learning_rates": [rate for s in self.segments for rate in s.learning_rates],
            "eval_losses": {str(step): loss for s in self.segments for step, loss in zip(s.eval_steps, s.eval_losses)},
            "tracking_failures": sum(s.tracking_failures for s in self.segments),
            "flow_s": time.perf_counter() - self.started,
            "launch_wall_s": sum(s.launch_wall_s for s in trained),
            "export_wall_s": self.export_wall_s,
            "upload_wait_s": self.state_uploads.waited_s if self.state_uploads else 0.0,
            "train_s": train_s,
            "tokens": tokens,
            "tokens_per_s": tokens / train_s if train_s > 0 else 0.0,
            "segments_trained": len(trained),
            "segments_reused": len(self.segments) - len(trained),
            "ledger_url": self.files.get(ledger.LEDGER_FILE),
            "loss_curve_url": self.files.get("loss_curve.png"),
        }

    def _report_flow_failure(self, error: Exception) -> Failure:
        """The failure as its task reported it, or reported now: one that happened in the flow's own code."""
        failure = reported(error)
        if failure is None:
            holds_run = self.lease is not None and self.run_id is not None
            # Only a run that holds its run lease writes into its run directory.
            run_dir = run_dir_for(self.config, self.run_id) if holds_run and self.run_id is not None else None
            stage = "flow" if holds_run else ("run-lease" if self.run_id else "plan")
            failure = report_failure(run_dir, self.run_id or self.config.run.name, stage, error)
        return failure

    def _end_tracking(self, status: RunEnd) -> None:
        """Mark the run's tracking record ended (MLflow's FINISHED, FAILED, KILLED); an outage is a warning only.

        Only a run that wrote its plan has a record to end; a stopped run waits at most a few seconds for it."""
        if self.planned_run is None:
            return
        timeout_s = 30.0 if status != "KILLED" else 5.0
        end_tracked_run(
            self.planned_run, status, warn=logging.getLogger("rankflow.tracking").warning, timeout_s=timeout_s
        )

    @contextlib.contextmanager
    def failures_reported(self) -> Iterator[None]:
        try:
            yield
            self._end_tracking("FINISHED")
        except BadInputError:
            self._end_tracking("FAILED")
            raise  # bad input (a storage setting included): the CLI prints one clean message and exits 2
        except RunAlreadyActive as busy:
            self.already_active = busy  # nothing was done: `outcome` ends the flow run as Cancelled
        except RunLeaseLost as lost:
            # Nor is the tracking record ended: it belongs to the run that holds the lease now.
            summary = self.summary("failed")  # no ledger entry, no report: the run directory is another run's now
            summary.update(
                error=f"{type(lost).__name__}: {lost}",
                failed_stage="run-lease",
                failure_cause="lease_lost",
                failed_rank=None,
            )
            raise RunFailed(f"run lease lost: {lost}", summary) from lost
        except Exception as error:
            failure = self._report_flow_failure(error)
            self._end_tracking("FAILED")
            summary = self.summary("failed")
            summary.update(
                error=f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}",
                failed_stage=failure.stage,
                failure_cause=failure.cause.value,
                failed_rank=failure.rank,
                failure_log=failure.log_file,
            )
            if in_prefect_run() and summary["run_id"]:
                emit_run_event(
                    RUN_FAILED,
                    summary["run_id"],
                    loss=summary["losses"][-1] if summary["losses"] else None,
                    labels={"rankflow.cause": failure.cause.value},
                    stage=failure.stage,
                    cause=failure.cause.value,
                    rank=failure.rank,
                    step=summary["steps"],
                    error=summary["error"],
                    url=flow_run_url() or self.config.storage.url,
                )
            details = f" (full error and traceback: {failure.log_file})" if failure.log_file else ""
            raise RunFailed(f"{failure.headline()}{details}", summary) from error
        except BaseException as stopped:  # Ctrl-C, SIGTERM, a cancelled flow run: the run was stopped, not failed
            self._end_tracking("KILLED")
            # The CLI's result line after a Ctrl-C names the run and what it did (flows/cli/run.py `_interrupted`).
            with contextlib.suppress(AttributeError, TypeError):
                stopped.rankflow_summary = self.summary("interrupted")  # pyright: ignore[reportAttributeAccessIssue]
            raise
        finally:
            self._release_lease()

    def _release_lease(self) -> None:
        if self.lease is not None:
            # An unreachable store must not replace the error that ended the run;
            # an unreleased lease expires after run.lease_ttl_s.
            with contextlib.suppress(OSError):
                self.lease.release()
            self.lease = None
