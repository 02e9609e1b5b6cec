"""Prefect's temporary API server for `rankflow run`: one start at a time per Prefect home, and it dies with the CLI.

Without PREFECT_API_URL, Prefect starts a temporary server at its first client
call (`SubprocessASGIServer`: uvicorn on the SQLite database in the Prefect
home, migrated at its start). Left to Prefect, two things go wrong:

- the server outlives a `rankflow run` that is SIGKILLed (the main process
  alone, not its group): re-parented to init, it kept listening with its
  SQLite open for as long as anyone looked (Prefect stops it from an exit
  hook, which a killed process never runs);
- two runs on one Prefect home started together migrate the same SQLite file
  at once, and one of them fails ("No such index …").

`start_temporary_server` starts it itself, before the flow, so Prefect's
clients find it running. It holds an exclusive lock on a file in the Prefect
home (`LOCK_NAME`) from before the spawn until the server answers, i.e. until
its migrations are done; a second run waits there and says so. The server's
process arms the kernel's parent-death signal (SIGKILL) before it execs, as
the warm ranks do (`trainer_core.run.process_boot`), and runs in a session
of its own, so a Ctrl-C at the terminal reaches the CLI alone, which then
stops the server itself (`flows.finish.stop_temporary_server`). The signal
follows the thread that forked, so the server is started from the main thread
only; from any other thread it is started as Prefect would.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trainer_core.run.process_boot import PR_SET_PDEATHSIG

__all__ = ["LOCK_NAME", "start_temporary_server"]

LOCK_NAME = ".rankflow-temporary-server.lock"
"""The file in the Prefect home whose lock a run holds while its temporary server starts and migrates."""


def start_temporary_server() -> int | None:
    """Start Prefect's temporary server (once per process) and return its pid; None when Prefect would start none."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None  # a server of the user's, or none allowed (Prefect's first call then says which to set)
    from prefect.server.api import server as server_module

    server = server_module.SubprocessASGIServer()
    if not server.running:
        home = Path(PREFECT_HOME.value())
        home.mkdir(parents=True, exist_ok=True)
        with _held(home / LOCK_NAME), _spawns_tied_to_this_process(server_module):
            server.start()
    assert server.server_process is not None  # start() raises when the server does not come up
    return server.server_process.pid


@contextmanager
def _held(lock_path: Path) -> Iterator[None]:
    """An exclusive lock on `lock_path` (released when the block ends, or by the kernel when this process dies)."""
    with open(lock_path, "a") as lock:  # Popen closes it in the server (close_fds): the lock stays this process's
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(
                f"rankflow: waiting for another run's temporary Prefect server to start ({lock_path} is locked; "
                "runs on one Prefect home start their servers one at a time)",
                file=sys.stderr,
                flush=True,
            )
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class _TiedSubprocess:
    """The `subprocess` module as Prefect's server module sees it: its Popen ties the child to this process."""

    def __init__(self, before_exec: Callable[[], None] | None) -> None:
        self._before_exec = before_exec

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    def Popen(self, *args: Any, **kwargs: Any) -> subprocess.Popen[Any]:  # noqa: N802 - subprocess's name
        kwargs.setdefault("start_new_session", True)
        theirs, ours = kwargs.pop("preexec_fn", None), self._before_exec
        if theirs is not None and ours is not None:

            def both() -> None:  # a preexec_fn Prefect passes itself is kept, after the tie
                ours()
                theirs()

            return subprocess.Popen(*args, preexec_fn=both, **kwargs)
        return subprocess.Popen(*args, preexec_fn=theirs or ours, **kwargs)


def _parent_death_signal() -> Callable[[], None] | None:
    """What the child runs between fork and exec: SIGKILL when this process dies; None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: a forked child must not load anything
    parent = os.getpid()

    def arm() -> None:
        if prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != parent:
            os._exit(1)  # could not arm, or the parent died before it took effect: never outlive it

    return arm


@contextmanager
def _spawns_tied_to_this_process(server_module: Any) -> Iterator[None]:
    """`prefect.server.api.server` (typed Any: its `subprocess` is swapped) spawning through `_TiedSubprocess`."""
    if threading.current_thread() is not threading.main_thread():
        yield  # the signal would follow this thread, not the process: Prefect's own spawn
        return
    original = server_module.subprocess
    server_module.subprocess = _TiedSubprocess(_parent_death_signal())
    try:
        yield
    finally:
        server_module.subprocess = original
