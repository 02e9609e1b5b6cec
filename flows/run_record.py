"""What a flow run has done so far, its summary, and the one place where a run's failure is reported.

`RunRecord.failures_reported()` wraps the pipeline from plan to cleanup: a
failure anywhere ends as `RunFailed`, whose summary keeps the run id, the
steps done and the losses so far, after a `rankflow.run.failed` event and a
failure report (when the failing task did not already write one). A run
lease, held for the whole run, belongs in the same place.

Figures describe this flow run: training time, tokens and tokens/s count only
the segments it trained (reused ones took no time now), so a resumed run
reports its own speed and `launch_overhead_s` is never negative.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.runtime import flow_run

from infra import ledger
from infra.publication import CommitOutcome
from tasks.events import RUN_FAILED, emit_run_event, flow_run_url
from tasks.failure_report import report_failure
from tasks.live import in_prefect_run
from tasks.outcomes import ExportOutcome, PlannedRun, SegmentOutcome
from trainer_core.config import RunConfig
from trainer_core.errors import BadInputError


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
        self.files: dict[str, str] = {}

    def planned(self, planned: PlannedRun) -> PlannedRun:
        """Keep the plan, and name the flow run after the run id (known only now)."""
        self.planned_run = planned
        if flow_run.get_id() is not None:
            with get_client(sync_client=True) as client:
                client.update_flow_run(flow_run.get_id(), name=planned.run_id)
        return planned

    def exported(self, staged: ExportOutcome) -> ExportOutcome:
        self.export_wall_s += staged.launch_wall_s
        return staged

    def summary(self, status: str) -> dict:
        trained = [s for s in self.segments if not s.reused]
        train_s = sum(s.train_s for s in trained)
        tokens = sum(s.num_tokens for s in trained)
        return {
            "run_id": self.planned_run.run_id if self.planned_run else None,
            "status": status,
            "checkpoint_url": self.commits[-1].checkpoint_url if self.commits else None,
            "steps": self.segments[-1].end_step if self.segments else 0,
            "losses": [loss for s in self.segments for loss in s.losses],
            "flow_s": time.perf_counter() - self.started,
            "launch_wall_s": sum(s.launch_wall_s for s in trained),
            "export_wall_s": self.export_wall_s,
            "train_s": train_s,
            "tokens": tokens,
            "tokens_per_s": tokens / train_s if train_s > 0 else 0.0,
            "segments_trained": len(trained),
            "segments_reused": len(self.segments) - len(trained),
            "ledger_url": self.files.get(ledger.LEDGER_FILE),
            "loss_curve_url": self.files.get("loss_curve.png"),
        }

    def _reported_failure(self) -> dict | None:
        """The failure a task of this flow run recorded in the ledger, newest first."""
        if self.planned_run is None:
            return None
        for entry in reversed(ledger.read(Path(self.planned_run.run_dir))):
            if entry["time"] < self.started_at:
                return None
            if entry["status"] == "failed" and "failure" in entry:
                return entry["failure"]
        return None

    @contextlib.contextmanager
    def failures_reported(self) -> Iterator[None]:
        try:
            yield
        except BadInputError:
            raise  # bad input (a storage setting included): the CLI prints one clean message and exits 2
        except Exception as error:
            failure = self._reported_failure()
            if failure is None:
                planned = self.planned_run
                failure = report_failure(Path(planned.run_dir) if planned else None,
                                         planned.run_id if planned else self.config.run.name,
                                         "flow" if planned else "plan", error).to_dict()
            summary = self.summary("failed")
            summary.update(error=f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}",
                           failed_stage=failure["stage"], failure_cause=failure["cause"], failed_rank=failure["rank"])
            if in_prefect_run() and summary["run_id"]:
                emit_run_event(RUN_FAILED, summary["run_id"], loss=summary["losses"][-1] if summary["losses"] else None,
                               labels={"rankflow.cause": failure["cause"]}, stage=failure["stage"],
                               cause=failure["cause"], rank=failure["rank"], step=summary["steps"],
                               error=summary["error"], url=flow_run_url() or self.planned_run.storage_url)
            raise RunFailed(f"{failure['stage']} failed: {summary['error']}", summary) from error
