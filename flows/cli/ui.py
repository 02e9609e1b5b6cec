"""Start a Prefect server with its UI on 127.0.0.1 and say how to point runs at it.

The server's output goes to a log file, never to a pipe nobody reads (a full
pipe blocks the server: health checks then time out and SIGTERM no longer
stops it). Its telemetry is off unless the user turned it on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

DEFAULT_LOG = ".rankflow/prefect-server.log"


def wait_healthy(api_url: str, timeout_s: float, process: subprocess.Popen) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
                if response.status == 200:
                    return True
        except OSError:
            time.sleep(0.5)
    return False


def server_command(port: int) -> list[str]:
    return [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]


def server_env(port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Without it the UI's pages call the API on the default port (4200), whatever --port says.
    env.setdefault("PREFECT_UI_API_URL", f"http://127.0.0.1:{port}/api")
    return env


def start_server(port: int, log_path: Path, command: Sequence[str] | None = None) -> tuple[subprocess.Popen, str]:
    """Start the server with stdout and stderr appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:  # the child keeps its own descriptor
        process = subprocess.Popen(
            list(command or server_command(port)),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=server_env(port),
            start_new_session=True,
        )
    return process, f"http://127.0.0.1:{port}/api"


def stop_server(process: subprocess.Popen, timeout_s: float = 30.0) -> int:
    process.terminate()
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.wait()


def _log_tail(log_path: Path, num_bytes: int = 2000) -> str:
    data = log_path.read_bytes() if log_path.is_file() else b""
    return data[-num_bytes:].decode(errors="replace")


def run_ui(port: int = 4200, startup_timeout_s: float = 90.0, log_path: Path = Path(DEFAULT_LOG)) -> int:
    process, api_url = start_server(port, log_path)
    if not wait_healthy(api_url, startup_timeout_s, process):
        stop_server(process)
        print(
            f"rankflow ui: the Prefect server did not start on port {port}; is the port taken? "
            f"Try --port. Its log ({log_path}) ends with:\n{_log_tail(log_path)}",
            file=sys.stderr,
        )
        return 1
    print(f"Prefect UI: http://127.0.0.1:{port}")
    print(f"Server log: {log_path}")
    print("Point runs and deployments at it in another shell:")
    print(f"  export PREFECT_API_URL={api_url}")
    print("Stop with Ctrl-C.", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: process.terminate())
    try:
        process.wait()
    except KeyboardInterrupt:
        stop_server(process)
    return 0
