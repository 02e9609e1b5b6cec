"""The export's progress records feed the same watchdog as a segment's, and its message names the stuck phase."""

from __future__ import annotations

from tasks.watchdog import ProgressWatch
from trainer_core.run.progress import ProgressWriter, export_progress_path, progress_path


def test_an_export_stuck_in_a_phase_is_named_after_stall_timeout(tmp_path):
    path = export_progress_path(tmp_path, 3)
    assert path != progress_path(tmp_path, 3)  # never mixed with the segment's records
    now = [0.0]
    watch = ProgressWatch(path, stall_timeout_s=10, clock=lambda: now[0])
    writer = ProgressWriter(path, rank=0)
    writer.write("ready")
    writer.write("phase", phase="weights")
    now[0] = 1.0
    assert watch() is None
    now[0] = 10.5
    assert watch() is None  # within stall_timeout_s of the last record
    now[0] = 11.5
    stalled = watch()
    assert stalled is not None and "no progress for 10 s" in stalled and "export phase 'weights'" in stalled
    writer.write("phase", phase="write")
    assert watch() is None  # a new phase is progress
    writer.close()
