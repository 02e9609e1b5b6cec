"""The README's MLflow UI command serves what a run's tracking sink logged: a real `mlflow ui`, asked over its REST API."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.unit.test_tracking import RUN_ID, train_twice

pytestmark = pytest.mark.ui


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/2.0/mlflow/{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as answer:  # an answer, however loaded the machine
        return json.loads(answer.read())


def test_mlflow_ui_shows_the_runs_steps_and_checkpoint(tmp_path):
    work_dir = tmp_path / ".rankflow" / "work"
    work_dir.mkdir(parents=True)
    train_twice("mlflow", f"sqlite:///{work_dir / 'mlflow.db'}")
    port = _free_port()
    mlflow = Path(sys.executable).with_name("mlflow")
    server = subprocess.Popen(  # the README's command, run where the README runs it (relative URI)
        [str(mlflow), "ui", "--backend-store-uri", "sqlite:///.rankflow/work/mlflow.db", "--port", str(port)],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300  # its first start migrates the database: slow on a loaded machine
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "mlflow ui did not come up"
                time.sleep(0.5)
        experiments = _post(port, "experiments/search", {"max_results": 10})["experiments"]
        experiment = next(e for e in experiments if e["name"] == "rankflow-test")
        (run,) = _post(port, "runs/search", {"experiment_ids": [experiment["experiment_id"]]})["runs"]
        assert run["info"]["run_name"] == RUN_ID
        history = urllib.request.urlopen(
            f"http://127.0.0.1:{port}/api/2.0/mlflow/metrics/get-history?run_id={run['info']['run_id']}&metric_key=loss",
            timeout=120,
        )
        steps = [m["step"] for m in json.loads(history.read())["metrics"]]
        assert sorted(steps) == list(range(8))
        tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
        assert tags["checkpoint_url"].endswith("step-00000008")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=300)
