"""Launch a trainer-core stage under torchrun for a task, recording a failure in the ledger."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from infra import ledger
from infra.launcher import LaunchResult, launch_or_raise

from .outcomes import PlannedRun


def launch_stage(planned: PlannedRun, stage: str, module: str, segment_index: int, extra_args: list[str],
                 on_line: Callable[[str], None]) -> LaunchResult:
    run_dir = Path(planned.run_dir)
    try:
        return launch_or_raise(
            module, ["--run-dir", str(run_dir), "--segment", str(segment_index), *extra_args],
            nproc_per_node=planned.nproc_per_node, timeout_s=planned.segment_timeout_s, on_line=on_line,
        )
    except Exception as error:
        # The first line names the failing rank and its error; the rest is torchrun's report.
        ledger.record(run_dir, stage, "failed", segment=segment_index, error=str(error).splitlines()[0])
        raise
