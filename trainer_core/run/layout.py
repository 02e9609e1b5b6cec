"""Every path under a run directory, in one place: `RunDir(run_dir)`.

    RUN_DIR/plan.json                        the plan, and its shards under plan/ (named by trainer_core.run.plan)
    RUN_DIR/state/segment-NNNN/              segment N's training state (`meta.json` beside one directory per checkpoint)
    RUN_DIR/segments/segment-NNNN.json       segment N's SegmentResult
    RUN_DIR/progress/segment-NNNN.jsonl      segment N's live progress records
    RUN_DIR/progress/export-NNNN.jsonl       the progress of the export of segment N's state
    RUN_DIR/planner/                         the memory planner's miss reports
    RUN_DIR/export/step-N/                   a staged export, and step-N.result.json (its ExportResult) beside it

The per-purpose functions the stages import (`state_dir_for`, `progress_path`,
`segment_result_path`, …) are these paths under their old names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunDir:
    path: Path

    def state_dir(self, segment_index: int) -> Path:
        return self.path / "state" / f"segment-{segment_index:04d}"

    def result_file(self, segment_index: int) -> Path:
        return self.path / "segments" / f"segment-{segment_index:04d}.json"

    def progress_file(self, segment_index: int) -> Path:
        return self.path / "progress" / f"segment-{segment_index:04d}.jsonl"

    def export_progress_file(self, segment_index: int) -> Path:
        return self.path / "progress" / f"export-{segment_index:04d}.jsonl"

    @property
    def planner_dir(self) -> Path:
        return self.path / "planner"

    @staticmethod
    def export_result_file(out_dir: Path) -> Path:
        """The ExportResult of the export staged at `out_dir`, beside it."""
        return out_dir.parent / f"{out_dir.name}.result.json"
