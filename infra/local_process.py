"""What the local services rankflow starts (PostgreSQL, a Prefect server) share.

Each runs as a child in its own session, bound to a free loopback port, with
its output in a log file, and is stopped by signalling its process group: a
polite signal first, SIGKILL after a timeout, so nothing it spawned outlives it.

A port found free can still be taken by another process before the service
binds it; callers retry a launch that fails on a port clash with a fresh draw.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["LOOPBACK", "log_tail", "pick_free_port", "port_is_free", "process_is_running", "stop_process_group"]

LOOPBACK = "127.0.0.1"
# Below Linux's default ephemeral range (32768-60999), so outgoing connections
# rarely hold a port drawn from here.
_DEFAULT_PORT_RANGE = (20000, 32000)
_NUM_PORT_DRAWS = 200
_NUM_LOG_TAIL_LINES = 40


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """Whether a TCP listener could bind `host:port` now (TIME_WAIT leftovers do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # Servers set SO_REUSEADDR (Go's listeners in weed, PostgreSQL, uvicorn), so a port
        # held only by TIME_WAIT connections is usable by them; mirror that to avoid false "busy".
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def pick_free_port(rng: random.Random | None = None, port_range: tuple[int, int] = _DEFAULT_PORT_RANGE,
                   host: str = LOOPBACK) -> int:
    """A random port in `[low, high)` that is free on `host` right now."""
    rng = rng or random.SystemRandom()
    for _ in range(_NUM_PORT_DRAWS):
        port = rng.randrange(*port_range)
        if port_is_free(port, host):
            return port
    raise RuntimeError(f"no free TCP port in {port_range[0]}-{port_range[1]} on {host} after {_NUM_PORT_DRAWS} "
                       "draws; stop other local servers (`ss -ltn` lists them) and retry")


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


def stop_process_group(pid: int, process: subprocess.Popen | None, first_signal: signal.Signals,
                       timeout_s: float, what: str) -> None:
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
    raise RuntimeError(f"{what} (pid {pid}) survived SIGKILL for {timeout_s}s; "
                       f"check it with `ps -o pid,stat,cmd -g {pid}` (state D means stuck in I/O)")


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
