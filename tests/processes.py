"""Which processes are alive, read from /proc: for tests that check a service left nothing behind."""

from __future__ import annotations

from pathlib import Path


def _stat_fields(entry: Path) -> list[str] | None:
    """The fields of /proc/PID/stat after the parenthesised command: state, ppid, pgrp, ..."""
    try:
        return (entry / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None  # exited while we looked


def _live_processes() -> dict[int, list[str]]:
    processes = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(entry)) is not None and fields[0] != "Z":
            processes[int(entry.name)] = fields
    return processes


def group_members(pgid: int) -> list[int]:
    """PIDs of the live processes in process group `pgid` (zombies excluded)."""
    return sorted(pid for pid, fields in _live_processes().items() if int(fields[2]) == pgid)


def descendants(pid: int) -> list[int]:
    """PIDs of the live descendants of `pid`, including those that started their own session."""
    children: dict[int, list[int]] = {}
    for child, fields in _live_processes().items():
        children.setdefault(int(fields[1]), []).append(child)
    found, frontier = [], [pid]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.append(child)
            frontier.append(child)
    return sorted(found)


def pid_alive(pid: int) -> bool:
    fields = _stat_fields(Path(f"/proc/{pid}"))
    return fields is not None and fields[0] != "Z"
