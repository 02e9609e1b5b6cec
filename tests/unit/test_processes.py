"""The process table as the launcher reads it (`infra.launch.processes`, through psutil), on real child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest

from infra.launch.processes import child_pids, descendant_pids, is_alive, is_stopped, rank_pids, wait_gone
from trainer_core.run.plan_size import available_memory_bytes


def _until(condition, timeout_s: float = 300.0) -> bool:  # returns as soon as it holds
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def launcher_like():
    """A shell standing in for torchrun: two children carrying RANK 0 and 1, and one without RANK."""
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    shell = subprocess.Popen(
        ["sh", "-c", "RANK=0 sleep 60 & RANK=1 sleep 60 & sleep 60 & wait"], env=env, start_new_session=True
    )
    # A forked child carries its RANK only once it has exec'd `sleep`: wait for that, not just for the fork.
    assert _until(lambda: len(child_pids(shell.pid)) == 3 and len(rank_pids(shell.pid)) == 2)
    yield shell
    os.killpg(shell.pid, signal.SIGKILL)
    shell.wait()


def test_ranks_are_the_children_that_carry_rank(launcher_like):
    ranks = rank_pids(launcher_like.pid)
    assert sorted(ranks) == [0, 1] and set(ranks.values()) < set(child_pids(launcher_like.pid))
    assert {launcher_like.pid, *child_pids(launcher_like.pid)} <= set(descendant_pids(os.getpid()))
    assert rank_pids(2**22 + 17) == {} and child_pids(2**22 + 17) == [] and descendant_pids(2**22 + 17) == []


def test_a_stopped_rank_is_seen_stopped_until_continued(launcher_like):
    pid = rank_pids(launcher_like.pid)[1]
    assert not is_stopped(pid)
    os.kill(pid, signal.SIGSTOP)
    assert _until(lambda: is_stopped(pid))
    assert is_alive(pid)  # stopped is not gone
    os.kill(pid, signal.SIGCONT)
    assert _until(lambda: not is_stopped(pid))


def test_a_zombie_is_not_alive_and_wait_gone_sees_it_go():
    child = subprocess.Popen(["sleep", "60"])
    assert is_alive(child.pid)
    child.kill()
    # Not yet reaped: a zombie, which holds a pid but no process.
    assert _until(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE)
    assert not is_alive(child.pid) and wait_gone([child.pid], timeout_s=1) == []
    child.wait()
    assert not is_alive(child.pid) and not is_stopped(child.pid)


def test_wait_gone_returns_the_pids_still_alive():
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert wait_gone([child.pid], timeout_s=0.3) == [child.pid]
    finally:
        child.kill()
        child.wait()


def test_available_memory_is_in_bytes_and_never_above_the_machines():
    available = available_memory_bytes()
    assert available is not None and 2**20 < available <= psutil.virtual_memory().total
