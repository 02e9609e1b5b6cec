"""Launch a trainer-core entry point under torchrun, stream its ranks' logs, and watch it.

torchrun runs with `--max-restarts=0` (restarts hung after a rank failure on
this kind of machine; retries belong to the orchestrator, which resumes from
the last saved state). Single-node launches rendezvous over 127.0.0.1 only
(`infra.launch.loopback_torchrun`). The launch runs in its own process group; a
timeout, a stall reported by the caller's monitor, or an interrupted caller
ends torchrun and every rank (`infra.launch.processes.kill_launch`), and a dead
caller takes the launch with it: torchrun and each rank start through
`trainer_core.run.process_boot`, which arms PR_SET_PDEATHSIG against the parent
that started it before any slow import, or exits if that parent is gone.

Each rank's output goes to its own file (torchrun `--redirects=3`) and is
forwarded as whole lines (`infra.launch.rank_logs`); the result keeps each rank's last
lines, the errors the ranks recorded, how each failed rank exited, and which
ranks were stopped when a stall was detected, so `infra.launch.failures` can name
the first failing rank and the cause.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from infra.launch.processes import handles_signal, is_stopped, kill_launch, rank_pids, signal_pids
from infra.launch.rank_logs import RankLogTail
from infra.launch.rendezvous import STORE_HOST_ENV, NodeRendezvous
from infra.launch.warm_ranks import launch_env
from trainer_core.run.process_boot import BOOT_SCRIPT, PARENT_PID_ENV
from trainer_core.run.rank_process import ERRORS_DIR_ENV, RankErrorRecord

STACK_DUMP_WAIT_S = 1.5
"""How long a stalled launch's ranks get to print their stacks before they are killed."""


class LaunchError(RuntimeError):
    """A torchrun launch failed; `result` holds what is known about it, `failure` the diagnosis."""

    def __init__(self, message: str, result: "LaunchResult", failure=None) -> None:
        super().__init__(message)
        self.result = result
        self.failure = failure


@dataclass(frozen=True)
class LaunchResult:
    returncode: int
    wall_s: float
    timed_out: bool
    tail: tuple[str, ...]
    """The last lines the launch printed (all ranks and torchrun), for error messages."""
    rank_errors: tuple[str, ...] = ()
    """The first `[rank N] ERROR …` lines: which rank failed and why."""
    stalled: str | None = None
    """Why the caller's monitor stopped the launch (no progress), or None."""
    rank_tails: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """Each rank's last lines."""
    rank_exits: dict[int, int] = field(default_factory=dict)
    """Exit status of each rank torchrun reported as failed (negative: killed by that signal)."""
    root_cause_rank: int | None = None
    """The rank torchrun saw fail first (its `Root Cause` section): the one it did not end itself."""
    error_records: tuple[dict, ...] = ()
    """The errors ranks recorded (rank, time, type, message, traceback), oldest first."""
    stopped_ranks: tuple[int, ...] = ()
    """Ranks found stopped (SIGSTOP) when the launch was ended for a stall or timeout."""
    log_dir: str | None = None
    """Where each rank's full log is, when the caller asked to keep them."""


def torchrun_command(
    module: str, args: list[str], nproc_per_node: int, log_dir: Path, node: NodeRendezvous | None = None
) -> list[str]:
    """torchrun for one node: the whole launch (`node` None), or node `node.node_rank` of a multi-node one.

    torchrun and each rank run through `trainer_core.run.process_boot` (by its
    path: the script torchrun runs on every rank), armed to die with their
    parent before they import anything that takes time.
    """
    rendezvous = (
        node.torchrun_args()
        if node is not None
        else [
            "--nnodes=1",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:0",
            f"--rdzv-id={uuid.uuid4().hex}",
            "--local-addr=127.0.0.1",
        ]
    )
    return [
        sys.executable,
        str(BOOT_SCRIPT),
        "infra.launch.loopback_torchrun",
        f"--nproc-per-node={nproc_per_node}",
        *rendezvous,
        "--max-restarts=0",
        "--monitor-interval=0.1",  # torchrun's default: a launch's end is seen within 0.1 s, not 0.5
        f"--log-dir={log_dir}",
        "--redirects=3",
        str(BOOT_SCRIPT),
        module,
        *args,
    ]


def _threads_per_rank(nproc_per_node: int) -> str:
    return str(max(1, (os.cpu_count() or 1) // nproc_per_node))


_FAILED_RANK = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def parse_rank_exits(torchrun_lines: list[str] | tuple[str, ...]) -> dict[int, int]:
    """{rank: exit status} from torchrun's failure summary (`rank : R (local_rank: L)` / `exitcode : C`)."""
    return {int(rank): int(code) for rank, code in _FAILED_RANK.findall("\n".join(torchrun_lines))}


def parse_root_cause_rank(torchrun_lines: list[str] | tuple[str, ...]) -> int | None:
    """The rank of torchrun's `Root Cause (first observed failure)` section, if it printed one.

    torchrun records the ranks it ends with SIGTERM after the first failure
    too, so two ranks may show the same signal; only this section says which
    one failed on its own.
    """
    text = "\n".join(torchrun_lines)
    _, found, root = text.rpartition("Root Cause (first observed failure)")
    exits = _FAILED_RANK.findall(root) if found else []
    return int(exits[0][0]) if exits else None


def _read_error_records(directory: Path) -> tuple[dict, ...]:
    records = []
    # Every rank's file by its global rank: on node K of several they do not start at 0.
    for path in sorted(directory.glob("rank-*.error.json")):  # trainer_core.run.rank_process.error_path
        try:
            records.append(RankErrorRecord.read(path).model_dump())  # checked; handed on as the dict it was
        except ValueError:
            continue  # a rank killed while writing (or a file that is no record): its log still tells
    return tuple(sorted(records, key=lambda r: r["time"]))


def _child_env(
    env: dict[str, str] | None, nproc_per_node: int, errors_dir: Path, node: NodeRendezvous | None = None
) -> dict[str, str]:
    child_env = {**os.environ, **launch_env(), **(env or {})}  # the run's warm process, when it has one
    child_env.setdefault("OMP_NUM_THREADS", _threads_per_rank(nproc_per_node))
    if node is None or node.is_loopback:
        # Collective traffic of a single-node (or one-machine) launch stays on loopback as well.
        child_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    else:
        child_env[STORE_HOST_ENV] = node.host  # node 0's store serves the other nodes at the endpoint
    child_env["PYTHONUNBUFFERED"] = "1"
    child_env[ERRORS_DIR_ENV] = str(errors_dir)
    child_env[PARENT_PID_ENV] = str(os.getpid())  # torchrun dies with this process (it names itself to the ranks)
    return child_env


@dataclass(frozen=True)
class _Ending:
    """How the watch ended: torchrun exited (all false), the timeout passed, or the monitor said why (a stall)."""

    timed_out: bool = False
    stalled: str | None = None
    stopped_ranks: tuple[int, ...] = ()


TORCHRUN_LOG = "torchrun.log"


class _LaunchOutput:
    """What a launch prints: torchrun's own lines (its pipe) and each rank's (its files), forwarded as whole lines.

    It keeps what the result reports: the last lines, torchrun's lines (its
    failure summary) and the first `[rank N] ERROR` lines. The log directory is
    the caller's, or a temporary one removed once the result is taken.
    """

    def __init__(self, log_dir: Path | None, tail_lines: int, on_line: Callable[[str], None]) -> None:
        self.keep = log_dir is not None
        self.directory = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="rankflow-launch-"))
        self.directory.mkdir(parents=True, exist_ok=True)
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self.torchrun_lines: list[str] = []
        self.rank_errors: list[str] = []
        self.rank_logs = RankLogTail(self.directory, self._forward)
        self._on_line = on_line
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._readers: list[threading.Thread] = []

    def _forward(self, line: str) -> None:
        with self._lock:
            self.tail.append(line)
            if line.startswith("[rank ") and "] ERROR " in line and len(self.rank_errors) < 8:
                self.rank_errors.append(line)
            self._on_line(line)

    def _pump_torchrun(self, process: subprocess.Popen) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.torchrun_lines.append(line.rstrip("\n"))
            self._forward(line.rstrip("\n"))

    def _pump_ranks(self) -> None:
        while not self._done.wait(0.2):
            self.rank_logs.poll()

    def follow(self, process: subprocess.Popen, module: str) -> None:
        """Start the two readers: torchrun's pipe, and every rank's files (polled)."""
        self._readers = [
            threading.Thread(target=self._pump_torchrun, args=(process,), name=f"torchrun-log-{module}", daemon=True),
            threading.Thread(target=self._pump_ranks, name=f"rank-logs-{module}", daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def stop(self, process: subprocess.Popen) -> None:
        """Stop the rank files' reader, drain torchrun's pipe (killing a straggler that holds it), read what is left."""
        pipe, files = self._readers
        self._done.set()
        files.join(timeout=5)
        pipe.join(timeout=5)
        if pipe.is_alive():  # a straggler still holds torchrun's pipe
            kill_launch(process)
            pipe.join(timeout=5)
        self.rank_logs.poll(final=True)
        if self.keep:  # torchrun's own lines beside the ranks' files: the kept logs hold every line the launch wrote
            (self.directory / TORCHRUN_LOG).write_text("".join(f"{line}\n" for line in self.torchrun_lines))

    def result(self, process: subprocess.Popen, wall_s: float, ending: _Ending) -> LaunchResult:
        """The launch's result; a temporary log directory is removed once it is read."""
        rank_logs = self.rank_logs
        result = LaunchResult(
            process.returncode,
            wall_s,
            ending.timed_out,
            tuple(self.tail),
            tuple(self.rank_errors),
            stalled=ending.stalled,
            rank_tails={r: rank_logs.last_lines(r) for r in sorted(rank_logs.tails)},
            rank_exits=parse_rank_exits(self.torchrun_lines),
            root_cause_rank=parse_root_cause_rank(self.torchrun_lines),
            error_records=_read_error_records(self.directory),
            stopped_ranks=ending.stopped_ranks,
            log_dir=str(self.directory) if self.keep else None,
        )
        if not self.keep:
            shutil.rmtree(self.directory, ignore_errors=True)
        return result


def _start_torchrun(
    module: str,
    args: list[str],
    nproc_per_node: int,
    log_dir: Path,
    env: dict[str, str] | None,
    node: NodeRendezvous | None,
) -> subprocess.Popen:
    # The thread that starts torchrun is the one that waits for it: PR_SET_PDEATHSIG
    # follows the thread that forked, so it must outlive the launch.
    return subprocess.Popen(
        torchrun_command(module, args, nproc_per_node, log_dir, node),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        env=_child_env(env, nproc_per_node, log_dir, node),
        start_new_session=True,
    )


def _watch(
    process: subprocess.Popen, timeout_s: float, monitor: Callable[[], str | None] | None, poll_s: float
) -> _Ending:
    """Wait for torchrun, asking `monitor` every `poll_s`; past the timeout or on a stall, end the launch."""
    timed_out, stalled = False, None
    deadline = time.monotonic() + timeout_s
    while process.poll() is None:
        try:
            process.wait(timeout=poll_s)
            break
        except subprocess.TimeoutExpired:
            pass
        timed_out = time.monotonic() > deadline
        stalled = None if timed_out or monitor is None else monitor()
        if timed_out or stalled:
            return _Ending(timed_out, stalled, _end_launch(process))
    return _Ending(timed_out, stalled)


def launch(
    module: str,
    args: list[str],
    *,
    nproc_per_node: int,
    timeout_s: float,
    on_line: Callable[[str], None] = print,
    env: dict[str, str] | None = None,
    tail_lines: int = 40,
    monitor: Callable[[], str | None] | None = None,
    log_dir: Path | None = None,
    poll_s: float = 0.5,
    node: NodeRendezvous | None = None,
) -> LaunchResult:
    """Run `module` on `nproc_per_node` ranks; returns when every rank has exited.

    `monitor` is called every `poll_s` in the calling thread while the launch
    runs; a string it returns is the reason to end the launch (a stall).
    `log_dir` keeps each rank's log there; without it they go to a temporary
    directory removed at the end. `node` makes this one node of a multi-node
    launch (`infra.launch.rendezvous`); without it the launch is the whole world.
    """
    output = _LaunchOutput(log_dir, tail_lines, on_line)
    started = time.perf_counter()
    process = _start_torchrun(module, args, nproc_per_node, output.directory, env, node)
    output.follow(process, module)
    try:
        ending = _watch(process, timeout_s, monitor, poll_s)
    except BaseException:
        kill_launch(process)  # an interrupted caller must not leave ranks running
        raise
    finally:
        output.stop(process)
    return output.result(process, time.perf_counter() - started, ending)


def _end_launch(process: subprocess.Popen) -> tuple[int, ...]:
    """Ask the ranks for their stacks (for the failure report), then kill the launch; returns stopped ranks."""
    ranks = rank_pids(process.pid)
    stopped = tuple(sorted(r for r, pid in ranks.items() if is_stopped(pid)))
    # Only ranks that installed the stack dump (a rank still importing would die of SIGUSR1).
    signal_pids(
        [pid for r, pid in ranks.items() if r not in stopped and handles_signal(pid, signal.SIGUSR1)], signal.SIGUSR1
    )
    time.sleep(STACK_DUMP_WAIT_S)
    kill_launch(process)
    return stopped


def launch_or_raise(module: str, args: list[str], *, stage: str = "launch", **kwargs) -> LaunchResult:
    """Launch; a failure raises LaunchError carrying the result and the diagnosis (`infra.launch.failures`)."""
    from infra.launch.failures import TIMEOUT_KEYS, diagnose_launch

    result = launch(module, args, **kwargs)
    if result.returncode == 0 and not result.timed_out and not result.stalled:
        return result
    failure = diagnose_launch(result, stage, kwargs.get("timeout_s"))
    if result.timed_out:
        key = TIMEOUT_KEYS.get(stage, "the stage's timeout")
        message = (
            f"{module} ran past its {kwargs.get('timeout_s')} s limit and was killed; "
            f"raise {key} or look at the last lines:\n"
        )
    elif result.stalled:
        message = f"{module} was killed by the stall watchdog: {result.stalled}\n"
    else:
        message = f"{module} failed: {'; '.join(result.rank_errors) or f'exit status {result.returncode}'}\n"
    raise LaunchError(f"{failure.headline()}\n{message}--- last lines ---\n" + "\n".join(result.tail), result, failure)
