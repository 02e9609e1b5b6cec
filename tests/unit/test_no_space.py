"""A full disk is its own failure class: named by device and path, never retried, whatever raised it.

Injected ENOSPC errors (no root needed); the real full disk is tests/cli/test_full_disk.py.
The references: the mount table of this machine (/proc/self/mountinfo, read
independently here) and the retry conditions Prefect consults.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from infra.launch.failures import Failure, FailureClass, classify_error, classify_exception
from infra.launch.launcher import LaunchError, LaunchResult
from infra.launch.no_space import describe_no_space
from tasks.failure_report import failure_of, report_failure
from tasks.retry_policy import retry_if_retriable, retry_unless_fenced


def _enospc(path: str | None = None) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


class _State:
    def __init__(self, error):
        self.data = error


def test_enospc_is_no_space_and_no_stage_retries_it():
    wrapped = ConnectionError("upload of the ledger failed")
    wrapped.__cause__ = _enospc()
    for error in (_enospc(), wrapped, OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))):
        assert classify_exception(error) is FailureClass.NO_SPACE
        assert not retry_if_retriable(None, None, _State(error))
        assert not retry_unless_fenced(None, None, _State(error))  # the publication stages retry everything else
    assert retry_unless_fenced(None, None, _State(ConnectionError("a storage outage")))
    # What a rank's error record says (type and message as text).
    assert classify_error("OSError", "[Errno 28] No space left on device") is FailureClass.NO_SPACE
    assert classify_error("OSError", "[Errno 5] Input/output error") is not FailureClass.NO_SPACE


def _mount_point_of(path: Path) -> str:
    target, best = os.path.realpath(path), "/"
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best = point
    return best


def test_the_report_names_the_disk_and_the_path(tmp_path):
    target = tmp_path / "work" / "run" / "ledger.jsonl"  # not created: the nearest existing parent decides the disk
    failure = failure_of("segment", _enospc(str(target)), run_dir=tmp_path / "work")
    assert failure.cause is FailureClass.NO_SPACE and not failure.retriable
    assert f":{target} (" in failure.detail and f"mounted at {_mount_point_of(tmp_path)}," in failure.detail
    assert failure.detail.startswith("no space on ") and " free)" in failure.detail
    assert describe_no_space(target) in failure.detail
    assert "free space on that disk (or point run.work_dir at a larger one)" in failure.headline()


def test_a_rank_that_could_not_even_say_why_on_a_full_disk_is_no_space(tmp_path, monkeypatch):
    """A rank whose every write fails (its error record and its log too) leaves only an exit status."""
    result = LaunchResult(returncode=1, wall_s=1.0, timed_out=False, tail=())
    bare = Failure("segment", FailureClass.TRANSIENT, 0, "exit status 1")
    run_dir = tmp_path / "work" / "run"
    run_dir.mkdir(parents=True)
    assert failure_of("segment", LaunchError("segment failed", result, bare), run_dir).cause is FailureClass.TRANSIENT

    real_statvfs = os.statvfs

    def full(path):  # the disk as statvfs reports it once it is full
        stats = real_statvfs(path)
        return os.statvfs_result((stats.f_bsize, stats.f_frsize, stats.f_blocks, 0, 0, *stats[5:]))

    monkeypatch.setattr(os, "statvfs", full)
    error = LaunchError("segment failed", result, bare)
    failure = report_failure(run_dir, "run", "segment", error, segment=0)
    assert failure.cause is FailureClass.NO_SPACE and failure.rank == 0 and failure.detail.startswith("no space on ")
    assert classify_exception(error) is FailureClass.NO_SPACE  # what the task's retry condition will read
    assert not retry_if_retriable(None, None, _State(error))
