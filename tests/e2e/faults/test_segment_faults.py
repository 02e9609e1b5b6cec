"""Injected faults in a real 2-rank segment launch: the failure class, the first failing rank, the time to fail.

Each fault is injected by `trainer_core.run.faults` inside a real torchrun launch
of the tiny model; the segment task's function (`train_segment_fn`) runs the
launch with its watchdog, outside Prefect. After every failure no process of
the launch may be left, and a second call (the retry) resumes and finishes.
"""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from infra.launch.failures import FailureClass
from infra.launch.launcher import LaunchError
from tasks.plan import plan_run_fn
from tasks.run_state import publish_plan
from tasks.segment import train_segment_fn
from tests.conftest import tiny_tree
from tests.state_helpers import train_and_store
from trainer_core.config import config_from_dict
from trainer_core.run.faults import FAULT_ENV, FAULT_KIND_ENV

pytestmark = [pytest.mark.distributed]

STALL_TIMEOUT_S = 12
GONE_S = 300.0
"""How long an ended launch's processes may take to be reaped on a loaded machine; a second on a quiet one."""


def launch_processes(run_dir: Path) -> list[int]:
    """Live processes whose command line names this run directory (torchrun and its ranks)."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        cmdline, status = " ".join(process.info["cmdline"] or ()), process.info["status"]
        if str(run_dir) in cmdline and status not in (None, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            found.append(process.pid)
    return found


@pytest.fixture
def planned(tmp_path):
    # Three steps in one segment; a short watchdog so a stopped rank fails fast.
    config = config_from_dict(
        tiny_tree(
            tmp_path,
            train={"steps": 3, "steps_per_segment": 3, "stall_timeout_s": STALL_TIMEOUT_S, "collective_timeout_s": 120},
        ),
        config_dir=tmp_path,
    )
    return plan_run_fn(config)


def _assert_launch_gone(run_dir: Path, what: str) -> None:
    """Every process of the ended launch is gone: waited for, as a loaded machine may take seconds to reap them."""
    deadline = time.monotonic() + GONE_S
    while launch_processes(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert launch_processes(run_dir) == [], what


def fail_segment(planned, monkeypatch, tmp_path, kind: str, step: int = 1, rank: int = 1):
    marker = tmp_path / f"fault-{kind}"
    monkeypatch.setenv(FAULT_ENV, f"{step}:{rank}:{marker}")
    monkeypatch.setenv(FAULT_KIND_ENV, kind)
    with pytest.raises(LaunchError) as raised:
        train_segment_fn(planned, 0, on_line=lambda _: None)
    ended = time.time()
    assert marker.is_file(), "the fault was not injected"
    time_to_fail_s = ended - marker.stat().st_mtime
    _assert_launch_gone(Path(planned.run_dir), "a process of the failed launch survived")
    return raised.value.failure, time_to_fail_s


@pytest.mark.parametrize(
    "kind, cause, retriable",
    [
        ("kill", FailureClass.RANK_DIED, True),
        ("stop", FailureClass.RANK_STALLED, True),
    ],
)
def test_a_dead_or_stopped_rank_fails_the_segment_before_any_collective_times_out_and_the_retry_finishes(
    planned, monkeypatch, tmp_path, kind, cause, retriable
):
    failure, time_to_fail_s = fail_segment(planned, monkeypatch, tmp_path, kind)
    print(f"time to fail, {kind} rank: {time_to_fail_s:.1f} s")
    # Its own cause, not the collective timeout (120 s) its peer would reach: the launch saw the death or the stall
    # first, which no wall-time bound on a loaded machine proves.
    assert failure.cause is cause and failure.retriable is retriable
    assert failure.rank == 1 and failure.stage == "segment"
    retried = train_segment_fn(planned, 0, on_line=lambda _: None)  # the marker says: fault done
    assert len(retried.losses) == 3 and not retried.reused


@pytest.mark.parametrize(
    "kind, cause",
    [
        ("code", FailureClass.CODE_ERROR),
        ("data", FailureClass.BAD_INPUT),
        ("term", FailureClass.PREEMPTED),
    ],
)
def test_each_failure_class_is_named_with_its_rank(planned, monkeypatch, tmp_path, kind, cause):
    failure, _ = fail_segment(planned, monkeypatch, tmp_path, kind, step=0)
    assert failure.cause is cause and failure.rank == 1
    assert failure.retriable is cause.retriable
    assert any("rank 1" in line or "[rank" in line for line in failure.log_tail)


def test_a_hung_rank_times_out_its_peers_collective(planned, monkeypatch, tmp_path):
    # The watchdog is set longer than the collective timeout: the peer's collective fails first.
    planned = planned.model_copy(update={"train": planned.train.model_copy(update={"stall_timeout_s": 120})})
    config_path = Path(planned.run_dir) / "plan.json"
    config_path.write_text(config_path.read_text().replace('"collective_timeout_s": 120', '"collective_timeout_s": 8'))
    publish_plan(planned)  # the store's plan is the one a segment uses (a local copy that differs is replaced)
    failure, time_to_fail_s = fail_segment(planned, monkeypatch, tmp_path, "hang", step=1)
    print(f"time to fail, hung rank: {time_to_fail_s:.1f} s")
    # The collective's timeout (8 s), not the watchdog's (120 s): the cause says which came first.
    assert failure.cause is FailureClass.COLLECTIVE_TIMEOUT and failure.retriable
    assert failure.rank == 1  # the silent rank, not the one whose collective timed out


def test_the_export_launch_has_its_own_timeout(tmp_path):
    from tasks.export import export_segment_fn

    config = config_from_dict(
        tiny_tree(tmp_path, export={"timeout_s": 1.5}, train={"nproc_per_node": 1}), config_dir=tmp_path
    )
    planned = plan_run_fn(config)
    assert planned.export.timeout_s == 1.5 and planned.train.segment_timeout_s == 300
    train_and_store(planned, 0, on_line=lambda _: None)  # the export fetches a state that must be in the store
    with pytest.raises(LaunchError, match="ran past its 1.5 s limit") as raised:  # its own, not the segment's 300 s
        export_segment_fn(planned, 0, on_line=lambda _: None)
    assert raised.value.failure.cause is FailureClass.LAUNCH_TIMEOUT
    assert "export failed: launch_timeout" in str(raised.value) and "--set export.timeout_s=" in str(raised.value)
    assert launch_processes(Path(planned.run_dir)) == []


def test_a_hung_export_rank_is_ended_by_the_stall_watchdog_and_the_retry_exports(planned, monkeypatch, tmp_path):
    from tasks.export import export_segment_fn
    from trainer_core.run.faults import EXPORT_FAULT_ENV

    # The collective timeout (60 s) is far past the watchdog's (12 s): only the watchdog can end it in time.
    config_path = Path(planned.run_dir) / "plan.json"
    config_path.write_text(config_path.read_text().replace('"collective_timeout_s": 120', '"collective_timeout_s": 60'))
    publish_plan(planned)
    train_and_store(planned, 0, on_line=lambda _: None)  # the state the export loads, in the store
    marker = tmp_path / "export-hang"
    monkeypatch.setenv(EXPORT_FAULT_ENV, f"1:{marker}")
    monkeypatch.setenv(FAULT_KIND_ENV, "hang")
    with pytest.raises(LaunchError, match="stall watchdog") as raised:
        export_segment_fn(planned, 0, on_line=lambda _: None)
    time_to_fail_s = time.time() - marker.stat().st_mtime
    print(f"time to fail, hung export rank: {time_to_fail_s:.1f} s")
    failure = raised.value.failure
    assert failure.cause is FailureClass.RANK_STALLED and failure.retriable and failure.stage == "export"
    assert failure.rank == 1  # the hung rank, not the one waiting for it in a collective (that would be 60 s)
    _assert_launch_gone(Path(planned.run_dir), "a process of the ended export survived")
    retried = export_segment_fn(planned, 0, on_line=lambda _: None)  # the marker says: fault done
    assert retried.step == 3 and (Path(retried.staged_dir) / "MANIFEST.json").is_file()
