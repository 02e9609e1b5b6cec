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


def test_a_previous_attempts_records_are_never_read_as_this_launchs(tmp_path):
    """A retry's watch starts while the failed attempt's file is still there: the new rank 0 truncates it and
    writes past the old length, and a reader that had read the old records would resume mid-record (CI: the
    killed-node retry failed on `JSONDecodeError: Extra data`)."""
    path = progress_path(tmp_path, 1)
    old = ProgressWriter(path, rank=0)
    for step in range(3):
        old.write("step", step=step, loss=6.9)
    old.close()
    watch = ProgressWatch(path, stall_timeout_s=10)
    assert watch() is None and watch.records == []  # the failed attempt's steps are not this launch's progress
    new = ProgressWriter(path, rank=0)  # the retry's rank 0
    new.write("ready", phases={"imports": 1.0, "process_group": 2.0, "model": 3.0, "state": 4.0, "total": 5.0})
    new.write("step", step=3, loss=6.5, grad_norm=1.25, tokens_per_s=1000.0, learning_rate=0.003)
    new.close()
    assert watch() is None
    assert [record["event"] for record in watch.records] == ["ready", "step"]
