"""`rankflow server` on the session's PostgreSQL, and what the tests that deploy onto it share.

tests/e2e/conftest.py starts one such server for the whole session (its
`prefect_server` fixture): the work pool tests (tests/e2e/deployments/) and
the node worker tests (tests/e2e/nodes/) each use pools of their own names on it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from infra.services.local_process import pick_free_port, stop_process_group
from infra.services.postgres import PostgresCluster
from infra.services.s3_server import CONFLICTING_AWS_ENV_VARS
from tests.conftest import tiny_tree
from tests.processes import descendants, group_members, pid_alive

RANKFLOW = str(Path(sys.executable).parent / "rankflow")
PREFECT = str(Path(sys.executable).parent / "prefect")
SERVER_START_TIMEOUT_S = 240  # migrating an empty database: ~10 s on a quiet machine
GONE_S = 300.0  # a server or worker told to stop, and what it started: seconds when quiet, bounded far above


@dataclass(frozen=True)
class RunningServer:
    api_url: str
    process: subprocess.Popen
    log_dir: Path


def client_env(api_url: str, home: Path) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name not in CONFLICTING_AWS_ENV_VARS}
    env.update(
        PREFECT_API_URL=api_url, PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1"
    )
    return env


def wait_for_output(path: Path, needle: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while needle not in path.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{needle!r} never appeared (exit code {process.poll()}):\n{path.read_text()[-3000:]}")
        time.sleep(0.5)


def stop_and_check_gone(process: subprocess.Popen, first_signal: signal.Signals, timeout_s: float, what: str) -> int:
    """Stop `process` (and its group), then check that no process it started survives; returns its exit code."""
    family = descendants(process.pid)
    if process.poll() is None:
        process.send_signal(first_signal)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_process_group(process.pid, process, signal.SIGKILL, 10, what)
            pytest.fail(f"{what} did not stop within {timeout_s}s of {first_signal.name}")
    deadline = time.monotonic() + GONE_S
    while (alive := [pid for pid in family if pid_alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert alive == [], f"processes started by {what} outlived it: {alive}"
    assert group_members(process.pid) == []
    return process.returncode


def start_rankflow_server(args: list[str], env: dict[str, str], log_dir: Path) -> tuple[subprocess.Popen, Path]:
    """`rankflow server ARGS --log …` in its own session, its output in `log_dir/stdout.txt`; returned once it
    says it is up (a failed test stops it with `stop_and_check_gone`)."""
    output = log_dir / "stdout.txt"
    with output.open("wb") as sink:
        process = subprocess.Popen(
            [RANKFLOW, "server", *args, "--log", str(log_dir / "server.log")],
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=log_dir,
            start_new_session=True,
        )
    try:
        wait_for_output(output, "Stop with Ctrl-C", process, SERVER_START_TIMEOUT_S)
    except BaseException:
        stop_and_check_gone(process, signal.SIGTERM, GONE_S, "rankflow server")
        raise
    return process, output


@contextmanager
def running_prefect_server(postgres_cluster: PostgresCluster, log_dir: Path) -> Iterator[RunningServer]:
    """`rankflow server` on the session's PostgreSQL (URL from the environment, as a user may give it), logging
    under `log_dir`; at the end stopped, checked gone, and its exit code checked."""
    port = pick_free_port()
    env = client_env("unused", log_dir / "home")
    del env["PREFECT_API_URL"]
    env["PREFECT_API_DATABASE_CONNECTION_URL"] = postgres_cluster.url(driver="postgresql")  # the command adds asyncpg
    process, output = start_rankflow_server(["--port", str(port)], env, log_dir)
    try:
        api_url = f"http://127.0.0.1:{port}/api"
        assert f"export PREFECT_API_URL={api_url}" in output.read_text()
        assert postgres_cluster.password not in output.read_text()
        yield RunningServer(api_url=api_url, process=process, log_dir=log_dir)
    finally:
        exit_code = stop_and_check_gone(process, signal.SIGTERM, GONE_S, "rankflow server")
    assert exit_code == 0, output.read_text()[-3000:]


def write_config(tmp_path: Path, **sections) -> Path:
    tree = tiny_tree(tmp_path, **sections)
    path = tmp_path / "run.toml"
    path.write_text(
        "\n".join(
            f"[{section}]\n" + "\n".join(f"{key} = {json.dumps(value)}" for key, value in values.items())
            for section, values in tree.items()
        )
    )
    return path


def wait_terminal(client, flow_run_ids, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        runs = {run_id: client.read_flow_run(run_id) for run_id in flow_run_ids}
        if all(run.state is not None and run.state.is_final() for run in runs.values()):
            return runs
        if time.monotonic() > deadline:
            pytest.fail(f"runs not finished after {timeout_s}s: {[(str(i), r.state_name) for i, r in runs.items()]}")
        time.sleep(1)
