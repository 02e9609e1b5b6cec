"""The run-directory layout (trainer_core/run/layout.py): the paths the stages have always used, from one class."""

from __future__ import annotations

from pathlib import Path

from trainer_core.run.layout import RunDir
from trainer_core.run.progress import export_progress_path, progress_path
from trainer_core.run.records import export_result_path
from trainer_core.run.segment_main import planner_reports_dir, segment_result_path
from trainer_core.run.state import state_dir_for


def test_every_path_keeps_its_place_under_the_run_directory():
    run = Path("/w/tiny-sft-a95ac4635b6a")
    layout = RunDir(run)
    expected = {
        state_dir_for(run, 3): "state/segment-0003",
        segment_result_path(run, 3): "segments/segment-0003.json",
        progress_path(run, 12): "progress/segment-0012.jsonl",
        export_progress_path(run, 12): "progress/export-0012.jsonl",
        planner_reports_dir(run): "planner",
        export_result_path(run / "export" / "step-00000006"): "export/step-00000006.result.json",
    }
    assert {str(path.relative_to(run)): where for path, where in expected.items()} == {v: v for v in expected.values()}
    assert layout.state_dir(3) == state_dir_for(run, 3) and layout.result_file(0) == segment_result_path(run, 0)
