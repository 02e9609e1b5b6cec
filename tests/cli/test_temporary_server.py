"""`rankflow run`'s temporary Prefect server: runs on one Prefect home start theirs one at a time; it dies with the CLI.

Two processes start the server as `rankflow run` does
(`flows.temporary_server.start_temporary_server`) on one fresh Prefect home
while this test holds the home's start lock: neither may spawn a server until
the lock is released (two migrations of one SQLite file at once failed with
"No such index …"); then both come up. Each process is then SIGKILLed alone
(not its group): its server must go too (it stayed, re-parented to init,
listening with its SQLite open). The references are the processes themselves
(/proc) and the servers' health endpoints.
"""

from __future__ import annotations

import fcntl
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from flows.temporary_server import LOCK_NAME
from infra.launch.processes import wait_gone
from tests.processes import descendants, pid_alive

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300.0  # two imports of Prefect and a migration of an empty database, on a loaded machine
GONE_TIMEOUT_S = 300.0  # gone in a second when quiet: the bound only ends a test that would hang

pytestmark = pytest.mark.flow  # Prefect's temporary server

_STARTER = """
import sys
from flows.temporary_server import start_temporary_server
from prefect.server.api.server import SubprocessASGIServer
pid = start_temporary_server()
print(pid, SubprocessASGIServer().api_url, flush=True)
sys.stdin.read()  # until the test kills this process
"""


class _Starter:
    """One process that starts the temporary server, its output lines read as they come."""

    def __init__(self, home: Path) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "PREFECT_HOME": str(home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": str(int(START_TIMEOUT_S)),
            "DO_NOT_TRACK": "1",
        }
        env.pop("PREFECT_API_URL", None)
        env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)  # the home's own SQLite, as on a fresh machine
        self.process = subprocess.Popen(
            [sys.executable, "-c", _STARTER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )
        self._lines: dict[str, queue.Queue[str]] = {"stdout": queue.Queue(), "stderr": queue.Queue()}
        self.stderr: list[str] = []
        for name, lines in self._lines.items():
            threading.Thread(target=self._pump, args=(getattr(self.process, name), lines), daemon=True).start()

    @staticmethod
    def _pump(stream, lines: queue.Queue[str]) -> None:
        for line in stream:
            lines.put(line)
        lines.put("")  # end of stream

    def wait_line(self, name: str, contains: str) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                line = self._lines[name].get(timeout=1)
            except queue.Empty:
                continue
            if name == "stderr":
                self.stderr.append(line)
            if line == "":
                break
            if contains in line:
                return line
        pytest.fail(
            f"no {name} line with {contains!r} (exit code {self.process.poll()}): {''.join(self.stderr)[-3000:]}"
        )

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def _healthy(api_url: str) -> bool:
    with urllib.request.urlopen(f"{api_url}/health", timeout=120) as response:
        return response.status == 200


def test_runs_on_one_home_start_their_servers_in_turn_and_each_server_dies_with_its_run(tmp_path):
    home = tmp_path / "prefect-home"
    home.mkdir()
    starters: list[_Starter] = []
    servers: list[int] = []
    try:
        with open(home / LOCK_NAME, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another run's server starting: both must wait for it
            starters = [_Starter(home), _Starter(home)]
            for starter in starters:
                starter.wait_line("stderr", "waiting for another run's temporary Prefect server")
            # Both are blocked on the lock: neither has spawned a server (it would migrate the home's database).
            assert [descendants(starter.process.pid) for starter in starters] == [[], []]
            fcntl.flock(lock, fcntl.LOCK_UN)
        for starter in starters:
            pid, api_url = starter.wait_line("stdout", "http://").split()
            servers.append(int(pid))
            assert int(pid) in descendants(starter.process.pid) and _healthy(api_url)
        for starter in starters:
            starter.process.send_signal(signal.SIGKILL)  # the CLI's main process alone, not its group
            starter.process.wait()
        assert wait_gone(servers, GONE_TIMEOUT_S) == []
    finally:
        for starter in starters:
            starter.kill()
        for pid in servers:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_preexec_fn_prefect_passes_is_kept_beside_the_tie(tmp_path):
    """The spawn's own `preexec_fn` (were Prefect to pass one) runs too, after the tie: neither replaces the other."""
    from flows.temporary_server import _TiedSubprocess

    tie, theirs = tmp_path / "tie", tmp_path / "theirs"
    spawn = _TiedSubprocess(lambda: os.close(os.open(tie, os.O_CREAT | os.O_WRONLY)))
    child = spawn.Popen(["true"], preexec_fn=lambda: os.close(os.open(theirs, os.O_CREAT | os.O_WRONLY)))
    assert child.wait(timeout=300) == 0
    assert tie.exists() and theirs.exists()
