"""A Prefect API server process (`prefect server start`) on a given database, for tests and for users.

`start_prefect_server` runs `python -m prefect server start` in its own
process group, bound to 127.0.0.1 by default, with its output in a log file
(never an unread pipe, which would stall the server once full) and the
server's telemetry off, and returns once `/api/health` answers.
`PrefectServer.stop` ends the group. The database is whatever
`database_url` names: `postgresql+asyncpg://...` for a server that workers on
other machines share, or SQLite for a single machine.

This module starts a process and talks HTTP to it; it does not import Prefect.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from infra.services.local_process import LOOPBACK, log_tail, pick_free_port, process_is_running, stop_process_group

__all__ = ["PrefectServer", "prefect_server_env", "start_prefect_server"]

_HEALTH_POLL_INTERVAL_S = 0.5


@dataclass(frozen=True)
class PrefectServer:
    """A running (or stopped) Prefect API server."""

    api_url: str
    """What clients and workers set as PREFECT_API_URL, e.g. ``http://127.0.0.1:4200/api``."""
    port: int
    pid: int
    """PID of the server, also its process group id."""
    log_path: Path
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)

    @property
    def ui_url(self) -> str:
        return self.api_url.removesuffix("/api")

    def is_running(self) -> bool:
        return process_is_running(self.pid, self._process)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after `timeout_s`; idempotent."""
        stop_process_group(self.pid, self._process, signal.SIGTERM, timeout_s, "the Prefect server")

    def __enter__(self) -> PrefectServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()


def prefect_server_env(
    database_url: str, *, home: Path | None = None, base: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment of a server process on `database_url` (holds the password: never log it)."""
    env = dict(os.environ if base is None else base)
    env["PREFECT_API_DATABASE_CONNECTION_URL"] = database_url
    # DO_NOT_TRACK does not stop the server's own telemetry; this does.
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    env.pop("PREFECT_API_URL", None)  # a client setting: a server does not talk to another API
    if home is not None:
        env["PREFECT_HOME"] = str(home)
    return env


def start_prefect_server(
    database_url: str,
    *,
    log_path: Path,
    port: int | None = None,
    host: str = LOOPBACK,
    home: Path | None = None,
    extra_env: dict[str, str] | None = None,
    startup_timeout_s: float = 120.0,
) -> PrefectServer:
    """Start `prefect server start` on `database_url` and wait until its API is healthy.

    The first start on an empty database runs Prefect's migrations (tens of
    seconds on a loaded 2-core machine). `port=None` picks a free one. Raises
    RuntimeError with the log's tail when the server exits or stays unhealthy.
    """
    port = pick_free_port() if port is None else port
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    api_host = LOOPBACK if host in ("0.0.0.0", "") else host
    api_url = f"http://{api_host}:{port}/api"
    env = prefect_server_env(database_url, home=home)
    # `prefect server start --port` does not reach the UI's settings: without this its pages call the API on
    # the default port (4200), another server's or none. A user's own value wins (a proxy, a public name).
    env.setdefault("PREFECT_UI_API_URL", api_url)
    env.update(extra_env or {})
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port)]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    server = PrefectServer(api_url=api_url, port=port, pid=process.pid, log_path=log_path, _process=process)
    try:
        healthy = _wait_healthy(server, process, time.monotonic() + startup_timeout_s)
    except BaseException:
        server.stop()
        raise
    if not healthy:
        exit_code = process.poll()
        server.stop()
        problem = (
            f"exited with code {exit_code}"
            if exit_code is not None
            else f"did not answer {server.api_url}/health within {startup_timeout_s}s"
        )
        raise RuntimeError(
            f"the Prefect server {problem}; is port {port} taken, or the database unreachable? "
            f"Last lines of {log_path}:\n{log_tail(log_path)}"
        )
    return server


def _wait_healthy(server: PrefectServer, process: subprocess.Popen[bytes], deadline: float) -> bool:
    while process.poll() is None:
        try:
            with urllib.request.urlopen(f"{server.api_url}/health", timeout=2) as response:
                if response.status == 200:
                    return True
        except (OSError, urllib.error.URLError):
            pass  # refused until uvicorn listens, which is after the migrations
        if time.monotonic() >= deadline:
            return False
        time.sleep(_HEALTH_POLL_INTERVAL_S)
    return False
