"""Launch a trainer-core stage under torchrun for a task, reporting a failure (ledger, artifact)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from infra.launch.launcher import LaunchResult, launch_or_raise
from infra.runs.run_lease import RunLeaseLost

from .failure_report import report_failure
from .launch_logs import store_launch_logs
from .outcomes import PlannedRun


def stage_log_dir(run_dir: Path, stage: str, segment_index: int) -> Path:
    """Where one attempt's per-rank logs are kept: RUN_DIR/logs/STAGE-NNNN/ATTEMPT-TIME."""
    return run_dir / "logs" / f"{stage}-{segment_index:04d}" / time.strftime("%Y%m%dT%H%M%S") / f"{time.monotonic_ns()}"


def launch_stage(
    planned: PlannedRun,
    stage: str,
    module: str,
    segment_index: int,
    extra_args: list[str],
    on_line: Callable[[str], None],
    *,
    timeout_s: float,
    monitor: Callable[[], str | None] | None = None,
) -> LaunchResult:
    run_dir = Path(planned.run_dir)
    log_dir = stage_log_dir(run_dir, stage, segment_index)
    try:
        return launch_or_raise(
            module,
            ["--run-dir", str(run_dir), "--segment", str(segment_index), *extra_args],
            stage=stage,
            nproc_per_node=planned.train.nproc_per_node,
            timeout_s=timeout_s,
            on_line=on_line,
            monitor=monitor,
            log_dir=log_dir,
        )
    except RunLeaseLost:
        raise  # another run owns the run directory now: record nothing in it
    except Exception as error:
        report_failure(run_dir, planned.run_id, stage, error, segment=segment_index)
        raise
    finally:
        store_launch_logs(planned, run_dir, log_dir)
