"""The processes of a torchrun launch, seen through /proc: its ranks, their state, and how to end them.

torchrun starts each rank in a session of its own, so killing torchrun's
process group does not reach them; ending a launch means signalling the ranks
themselves as well. Linux only (as torchrun's process handling is).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    return raw[raw.rindex(")") + 2:].split()


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state (R, S, D, T stopped, Z zombie), or None when gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


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
    return process_state(pid) not in (None, "Z", "X")


def child_pids(parent: int) -> list[int]:
    children = []
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields and int(fields[1]) == parent:
                children.append(int(entry.name))
    return children


def descendant_pids(root: int) -> list[int]:
    found, frontier = [], [root]
    while frontier:
        children = [c for parent in frontier for c in child_pids(parent)]
        found.extend(children)
        frontier = children
    return found


def _environ_value(pid: int, name: str) -> str | None:
    try:
        raw = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    prefix = name.encode() + b"="
    for item in raw.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix):].decode(errors="replace")
    return None


def rank_pids(torchrun_pid: int) -> dict[int, int]:
    """{global rank: pid} of the ranks torchrun has started (its children that carry RANK)."""
    ranks = {}
    for pid in child_pids(torchrun_pid):
        rank = _environ_value(pid, "RANK")
        if rank is not None and rank.isdigit():
            ranks[int(rank)] = pid
    return ranks


def signal_pids(pids: list[int] | tuple[int, ...], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # already gone


def kill_launch(process: subprocess.Popen, grace_s: float = 5.0) -> None:
    """End torchrun and every rank: ranks (stopped ones too) by SIGKILL, then torchrun's group."""
    signal_pids(descendant_pids(process.pid), signal.SIGKILL)
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
