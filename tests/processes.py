"""Which processes are alive, read through psutil: for tests that check a service left nothing behind."""

from __future__ import annotations

import os

import psutil


def _live_parents() -> dict[int, int]:
    """{pid: parent pid} of every live process (zombies and processes that exited while we looked excluded)."""
    processes = {}
    for process in psutil.process_iter(["ppid", "status"]):
        status, ppid = process.info["status"], process.info["ppid"]
        if status not in (None, psutil.STATUS_ZOMBIE) and ppid is not None:
            processes[process.pid] = ppid
    return processes


def group_members(pgid: int) -> list[int]:
    """PIDs of the live processes in process group `pgid` (zombies excluded)."""
    members = []
    for pid in _live_parents():
        try:
            if os.getpgid(pid) == pgid:
                members.append(pid)
        except ProcessLookupError:
            continue  # exited while we looked
    return sorted(members)


def descendants(pid: int) -> list[int]:
    """PIDs of the live descendants of `pid`, including those that started their own session."""
    children: dict[int, list[int]] = {}
    for child, parent in _live_parents().items():
        children.setdefault(parent, []).append(child)
    found, frontier = [], [pid]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.append(child)
            frontier.append(child)
    return sorted(found)


def pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
