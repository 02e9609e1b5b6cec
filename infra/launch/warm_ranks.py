"""A run's warm process: the ranks of its launches start with torch, transformers and the trainer core imported.

    with warm_ranks():          # the flow, from its start: the imports run beside planning
        launch(...)             # every launch on this machine: its ranks are forked, not imported

Each launch's ranks would import the same ~4-5 s of modules per process, and a
run launches every segment and every export. The warm process
(`trainer_core.run.warm_zygote`) imports them once; while it is active here,
the launcher's environment names it to the ranks (`launch_env`), and each
rank torchrun starts asks it for a forked child that runs the rank's module,
standing in for it (`trainer_core.run.warm_client`). A rank that finds it gone,
or asks for a module it does not hold, starts as before. Results are unchanged:
the child runs the same module with the same arguments, environment and
threads (the tests compare launches with and without it bitwise).

The warm process dies with this one (parent-death signal) and its children
with it; `warm_ranks` stops it on the way out. It serves launches on this
machine only: a work pool's node runs start their ranks as before.
"""

from __future__ import annotations

import contextvars
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from infra.launch.processes import is_alive, is_stopped
from trainer_core.run.process_boot import BOOT_SCRIPT, PARENT_PID_ENV
from trainer_core.run.warm_client import WARM_MODULES_ENV, WARM_PID_ENV, WARM_SOCKET_ENV

ENTRY_POINTS = ("trainer_core.run.segment_main", "trainer_core.run.export_main")
"""What a run launches: the modules the warm process imports and serves."""
DISABLE_ENV = "RANKFLOW_WARM_RANKS"
"""`0` starts every rank by itself (a comparison, or a machine where forking a warm process is not wanted)."""


@dataclass
class WarmProcess:
    process: subprocess.Popen
    directory: Path
    modules: tuple[str, ...]

    @property
    def socket_path(self) -> Path:
        return self.directory / "socket"

    def env(self) -> dict[str, str]:
        """What a launch's environment needs for its ranks to find this process."""
        return {
            WARM_SOCKET_ENV: str(self.socket_path),
            WARM_PID_ENV: str(self.process.pid),
            WARM_MODULES_ENV: ",".join(self.modules),
        }

    def is_ready(self) -> bool:
        return self.process.poll() is None and self.socket_path.exists()

    def is_usable(self) -> bool:
        """Alive and not stopped: a stopped one would keep each rank waiting for its answer."""
        return self.process.poll() is None and not is_stopped(self.process.pid)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()  # its children die with it (their parent-death signal)
        self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


PREFIX = "rankflow-warm-"
OWNER_FILE = "owner.pid"
"""In a warm directory: the pid of the process that started the warm process (it dies with that process)."""


def remove_orphaned_directories(parent: Path) -> list[Path]:
    """Remove the warm directories under `parent` whose owner is gone (a `rankflow run` that was SIGKILLed
    cannot remove its own); returns them. A directory without its owner's pid yet is being made: kept."""
    removed = []
    for directory in parent.glob(f"{PREFIX}*"):
        try:
            owner = (directory / OWNER_FILE).read_text()
        except OSError:
            continue
        if owner.isdigit() and not is_alive(int(owner)) and directory.stat().st_uid == os.getuid():
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed


_active: contextvars.ContextVar[WarmProcess | None] = contextvars.ContextVar("rankflow_warm_process", default=None)
"""The warm process of the flow run in this context (Prefect hands a flow's context to its tasks' threads)."""


def start_warm_process(modules: tuple[str, ...] = ENTRY_POINTS, env: dict[str, str] | None = None) -> WarmProcess:
    """Start a warm process importing `modules`; it is ready once its socket exists (`is_ready`)."""
    # Short and under /tmp: a Unix socket's path holds at most 107 bytes (a longer one: the warm process
    # fails to bind and exits, and the ranks start by themselves). The directory is this user's alone (0700).
    parent = Path("/tmp") if os.path.isdir("/tmp") else Path(tempfile.gettempdir())
    remove_orphaned_directories(parent)
    directory = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
    (directory / OWNER_FILE).write_text(str(os.getpid()))
    child_env = {**os.environ, **(env or {})}
    for name in (WARM_SOCKET_ENV, WARM_PID_ENV, WARM_MODULES_ENV):
        child_env.pop(name, None)  # it is no rank: it must never wait for itself
    child_env.update(
        {
            PARENT_PID_ENV: str(os.getpid()),
            "PYTHONUNBUFFERED": "1",
            "PYTORCH_NVML_BASED_CUDA_CHECK": "1",  # asking whether CUDA exists must not initialise it before a fork
        }
    )
    with open(directory / "warm.log", "wb") as log:
        process = subprocess.Popen(
            [sys.executable, str(BOOT_SCRIPT), "trainer_core.run.warm_zygote", "--socket", str(directory / "socket")]
            + list(modules),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env,
            start_new_session=True,  # a Ctrl-C at the terminal reaches the CLI, which stops it
        )
    return WarmProcess(process, directory, tuple(modules))


def launch_env() -> dict[str, str]:
    """The environment a launch adds for its ranks: the active warm process's names, or nothing."""
    warm = _active.get()
    return warm.env() if warm is not None and warm.is_usable() else {}


@contextmanager
def warm_ranks(modules: tuple[str, ...] = ENTRY_POINTS) -> Iterator[WarmProcess | None]:
    """Keep a warm process for the launches made inside; off when RANKFLOW_WARM_RANKS=0 or one is active already."""
    if os.environ.get(DISABLE_ENV) == "0" or _active.get() is not None:
        yield _active.get()
        return
    try:
        warm = start_warm_process(modules)
    except OSError:  # no temporary directory, no process to spare: the ranks start by themselves, as before
        yield None
        return
    token = _active.set(warm)
    try:
        yield warm
    finally:
        _active.reset(token)
        warm.stop()
