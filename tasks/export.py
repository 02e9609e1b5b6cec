"""The export stage: a torchrun launch that stages a Hugging Face checkpoint locally."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra import ledger
from infra.publication import checkpoint_name

from ._launch import launch_stage
from ._logging import rank_line_logger
from .outcomes import ExportOutcome, PlannedRun


def staged_dir_for(planned: PlannedRun, segment_index: int) -> Path:
    step = planned.segment_steps[segment_index][1]
    return Path(planned.run_dir) / "export" / checkpoint_name(step)


def export_segment_fn(planned: PlannedRun, segment_index: int, on_line=print) -> ExportOutcome:
    run_dir = Path(planned.run_dir)
    out_dir = staged_dir_for(planned, segment_index)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    launched = launch_stage(planned, "export", "trainer_core.export_main", segment_index, ["--out", str(out_dir)], on_line,
                            timeout_s=planned.export_timeout_s)
    result = json.loads((out_dir.parent / f"{out_dir.name}.result.json").read_text())
    manifest = json.loads((out_dir / "MANIFEST.json").read_text())
    outcome = ExportOutcome(
        segment=segment_index, step=result["step"], staged_dir=str(out_dir), reused=result["reused"],
        num_files=len(manifest["files"]) + 1, num_bytes=sum(f["size"] for f in manifest["files"]),
        launch_wall_s=launched.wall_s,
    )
    ledger.record(run_dir, "export", "completed", weights_sha256=result["weights_sha256"], **outcome.model_dump())
    return outcome


@task(name="export", task_run_name="export-segment-{segment_index}", retries=2, retry_delay_seconds=[2, 10], cache_policy=NO_CACHE)
def export_segment(planned: PlannedRun, segment_index: int) -> ExportOutcome:
    return export_segment_fn(planned, segment_index, on_line=rank_line_logger())
