"""Start a Prefect server with its UI on 127.0.0.1 and say how to point runs at it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request


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


def start_server(port: int) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    return process, f"http://127.0.0.1:{port}/api"


def run_ui(port: int = 4200, startup_timeout_s: float = 90.0) -> int:
    process, api_url = start_server(port)
    if not wait_healthy(api_url, startup_timeout_s, process):
        process.terminate()
        _, err = process.communicate(timeout=10)
        print(f"rankflow ui: the Prefect server did not start on port {port}; is the port taken? "
              f"Try --port.\n{err[-2000:]}", file=sys.stderr)
        return 1
    print(f"Prefect UI: http://127.0.0.1:{port}")
    print("Point runs and deployments at it in another shell:")
    print(f"  export PREFECT_API_URL={api_url}")
    print("Stop with Ctrl-C.", flush=True)
    stop = lambda *_: process.terminate()  # noqa: E731
    signal.signal(signal.SIGTERM, stop)
    try:
        process.wait()
    except KeyboardInterrupt:
        process.terminate()
        process.wait(timeout=30)
    return 0
