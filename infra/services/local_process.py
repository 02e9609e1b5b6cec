"""What the local services rankflow starts (PostgreSQL, a Prefect server) share.

Each runs as a child in its own session, bound to a free loopback port, with
its output in a log file, and is stopped by signalling its process group: a
polite signal first, SIGKILL after a timeout, so nothing it spawned outlives it.

A port found free can still be taken by another process before the service
binds it; callers retry a launch that fails on a port clash with a fresh draw.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from infra.launch.ports import LOOPBACK, pick_free_port, port_is_free

__all__ = ["LOOPBACK", "log_tail", "pick_free_port", "port_is_free", "process_is_running", "stop_process_group"]

_NUM_LOG_TAIL_LINES = 40


def process_is_running(pid: int, process: subprocess.Popen | None) -> bool:
    """Whether the process lives; a zombie counts as gone (and is reaped if it is our child)."""
    if process is not None:
        return process.poll() is None
    try:
        reaped_pid, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child
    else:
        if reaped_pid == pid:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def stop_process_group(
    pid: int, process: subprocess.Popen | None, first_signal: signal.Signals, timeout_s: float, what: str
) -> None:
    """Send `first_signal` to the group led by `pid`, SIGKILL after `timeout_s`; idempotent.

    Checked first: once the leader is reaped its PID may be reused, and
    signalling that group would hit an unrelated process.
    """
    if not process_is_running(pid, process):
        return
    for signum in (first_signal, signal.SIGKILL):
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            return
        if _wait_for_exit(pid, process, timeout_s):
            return
    raise RuntimeError(
        f"{what} (pid {pid}) survived SIGKILL for {timeout_s}s; "
        f"check it with `ps -o pid,stat,cmd -g {pid}` (state D means stuck in I/O)"
    )


def _wait_for_exit(pid: int, process: subprocess.Popen | None, timeout_s: float) -> bool:
    if process is not None:
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True
    deadline = time.monotonic() + timeout_s
    while process_is_running(pid, None):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def log_tail(path: Path, num_lines: int = _NUM_LOG_TAIL_LINES) -> str:
    """The last lines of a service's log, for an error message."""
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as error:
        return f"(could not read the log: {error})"
    return "\n".join(lines[-num_lines:]) or "(empty log)"
