"""Launch a trainer-core entry point under torchrun and stream its ranks' logs.

torchrun runs with `--max-restarts=0` (restarts hung after a rank failure on
this kind of machine; retries belong to the orchestrator, which resumes from
the last saved state). The launch runs in its own process group so that a
timeout kills torchrun and every rank, never leaving orphans behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


class LaunchError(RuntimeError):
    """A torchrun launch failed; the message carries the last lines it printed."""


@dataclass(frozen=True)
class LaunchResult:
    returncode: int
    wall_s: float
    timed_out: bool
    tail: tuple[str, ...]
    """The last lines the launch printed, for error messages."""
    rank_errors: tuple[str, ...] = ()
    """The first `[rank N] ERROR …` lines: which rank failed and why."""


def torchrun_command(module: str, args: list[str], nproc_per_node: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nnodes=1", f"--nproc-per-node={nproc_per_node}",
        "--max-restarts=0", "--monitor-interval=0.5",
        "-m", module, *args,
    ]


def _threads_per_rank(nproc_per_node: int) -> str:
    return str(max(1, (os.cpu_count() or 1) // nproc_per_node))


def _kill_group(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def launch(
    module: str,
    args: list[str],
    *,
    nproc_per_node: int,
    timeout_s: float,
    on_line: Callable[[str], None] = print,
    env: dict[str, str] | None = None,
    tail_lines: int = 40,
) -> LaunchResult:
    """Run `module` on `nproc_per_node` ranks; returns when every rank has exited."""
    child_env = {**os.environ, **(env or {})}
    child_env.setdefault("OMP_NUM_THREADS", _threads_per_rank(nproc_per_node))
    child_env["PYTHONUNBUFFERED"] = "1"
    started = time.perf_counter()
    process = subprocess.Popen(
        torchrun_command(module, args, nproc_per_node),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        text=True, errors="replace", env=child_env, start_new_session=True,
    )
    tail: deque[str] = deque(maxlen=tail_lines)
    rank_errors: list[str] = []

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            if line.startswith("[rank ") and "] ERROR " in line and len(rank_errors) < 8:
                rank_errors.append(line)
            on_line(line)

    reader = threading.Thread(target=pump, name=f"torchrun-log-{module}", daemon=True)
    reader.start()
    timed_out = False
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(process)
    except BaseException:
        _kill_group(process)  # an interrupted caller must not leave ranks running
        raise
    # Ranks may have left children holding the pipe open; the group kill ends them.
    reader.join(timeout=5)
    if reader.is_alive():
        _kill_group(process)
        reader.join(timeout=5)
    return LaunchResult(process.returncode, time.perf_counter() - started, timed_out, tuple(tail), tuple(rank_errors))


def launch_or_raise(module: str, args: list[str], **kwargs) -> LaunchResult:
    result = launch(module, args, **kwargs)
    if result.timed_out:
        raise LaunchError(f"{module} ran past its {kwargs.get('timeout_s')} s limit and was killed; "
                          "raise train.segment_timeout_s or look at the last lines:\n" + "\n".join(result.tail))
    if result.returncode != 0:
        cause = "; ".join(result.rank_errors) or f"exit status {result.returncode}"
        raise LaunchError(f"{module} failed: {cause}\n--- last lines ---\n" + "\n".join(result.tail))
    return result
