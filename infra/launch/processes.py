"""The processes of a torchrun launch: its ranks, their state, and how to end them.

torchrun starts each rank in a session of its own, so killing torchrun's
process group does not reach them; ending a launch means signalling the ranks
themselves as well. The process table (children, state, environment) is read
through psutil; only a process's signal handlers are read from /proc by hand
(its SigCgt mask, which psutil does not expose). Linux only (as torchrun's
process handling is).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil

from trainer_core.run.warm_client import WARM_SOCKET_ENV
from trainer_core.run.warm_zygote import children_dir

PROC = Path("/proc")
_GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def _status(pid: int) -> str | None:
    """psutil's status (running, sleeping, stopped, zombie, …), or None when the process is gone."""
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return None


def is_stopped(pid: int) -> bool:
    """Whether the process is stopped by a signal (SIGSTOP, SIGTSTP: state T)."""
    return _status(pid) == psutil.STATUS_STOPPED


def handles_signal(pid: int, sig: int) -> bool:
    """Whether the process has a handler installed for `sig` (its SigCgt mask in /proc)."""
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except OSError:
        pass  # gone
    return False


def is_alive(pid: int) -> bool:
    return _status(pid) not in (None, *_GONE)


def child_pids(parent: int) -> list[int]:
    try:
        return [child.pid for child in psutil.Process(parent).children()]
    except psutil.Error:
        return []


def descendant_pids(root: int) -> list[int]:
    try:
        return [child.pid for child in psutil.Process(root).children(recursive=True)]
    except psutil.Error:
        return []


def _environ_value(pid: int, name: str) -> str | None:
    try:
        return psutil.Process(pid).environ().get(name)
    except psutil.Error:  # gone, a zombie, or not ours to read
        return None


def _forked_rank(stand_in: int) -> int | None:
    """The pid of the process a run's warm process forked for the rank `stand_in` stands in for, if any."""
    socket_path = _environ_value(stand_in, WARM_SOCKET_ENV)
    if not socket_path:
        return None
    try:
        forked = (children_dir(socket_path) / str(stand_in)).read_text()
    except OSError:
        return None  # started by itself, not served yet, or ended
    return int(forked) if forked.isdigit() else None


def rank_pids(torchrun_pid: int) -> dict[int, int]:
    """{global rank: pid} of the ranks torchrun has started (its children that carry RANK).

    A rank forked by the run's warm process (`infra.launch.warm_ranks`) is that
    forked process, not torchrun's child that stands in for it: the one that
    runs the rank's code, stops, and prints its stacks.
    """
    ranks = {}
    for pid in child_pids(torchrun_pid):
        rank = _environ_value(pid, "RANK")
        if rank is not None and rank.isdigit():
            ranks[int(rank)] = _forked_rank(pid) or pid
    return ranks


def signal_pids(pids: list[int] | tuple[int, ...], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # already gone


def kill_launch(process: subprocess.Popen, grace_s: float = 5.0) -> None:
    """End torchrun and every rank: ranks (stopped ones too, forked ones too) by SIGKILL, then torchrun's group."""
    descendants = descendant_pids(process.pid)
    forked = [pid for pid in map(_forked_rank, descendants) if pid is not None]
    signal_pids(descendants + forked, signal.SIGKILL)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=grace_s)
            break
        except subprocess.TimeoutExpired:
            continue


def wait_gone(pids: list[int] | tuple[int, ...], timeout_s: float) -> list[int]:
    """Wait until every pid is gone; returns those still alive at the deadline."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in pids if is_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if is_alive(p)]
    return alive
