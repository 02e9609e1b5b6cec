"""In Prefect: a run whose run id is held ends Cancelled with the holder's message, is not retried and writes
nothing; the CLI exits 75 with one line; `rankflow serve` deployments have a concurrency limit of 1, CANCEL_NEW."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from flows.cli import EXIT_ALREADY_RUNNING, main
from flows.pipeline import train_flow
from infra.runs.run_lease import acquire_run_lease
from infra.store import open_store
from tasks.plan import compute_plan_fn
from tests.conftest import tiny_tree
from tests.e2e.run_lease.runs import client_env, start, wait_for, write_config
from trainer_core.config import config_from_dict, load_config

pytestmark = [pytest.mark.flow]


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_a_run_whose_run_id_is_held_ends_cancelled_writes_nothing_and_is_not_retried(prefect_harness, tmp_path):
    from prefect.client.orchestration import get_client

    config = config_from_dict(tiny_tree(tmp_path, run={"name": "lease-held"}), config_dir=tmp_path)
    run_id = compute_plan_fn(config).run_id
    store = open_store(config.storage.url)
    holder = acquire_run_lease(store, run_id, ttl_s=60, wait_s=0)
    try:
        before = _files(tmp_path / "store")
        state = train_flow(config, return_state=True)
        assert state.is_cancelled(), state
        assert (
            state.message.startswith(f"run {run_id} is already running: ")
            and f"pid {holder.record.pid}" in state.message
        )
        assert not (tmp_path / "work" / run_id).exists()  # no plan, no ledger, no state
        assert _files(tmp_path / "store") == before  # the store has only the holder's lease (and the probe is gone)
        with get_client(sync_client=True) as client:
            flow_run = client.read_flow_run(state.state_details.flow_run_id)
        assert flow_run.state.type.value == "CANCELLED" and flow_run.run_count == 1 and flow_run.name == run_id
    finally:
        holder.release()


def test_the_cli_exits_75_with_one_line_and_a_summary(prefect_harness, tmp_path, capsys):
    config_file = write_config(tmp_path)
    config = load_config(config_file)
    run_id = compute_plan_fn(config).run_id
    holder = acquire_run_lease(open_store(config.storage.url), run_id, ttl_s=60, wait_s=0)
    try:
        code = main(["run", str(config_file)])
    finally:
        holder.release()
    out, err = capsys.readouterr()
    assert code == EXIT_ALREADY_RUNNING == 75
    lines = [line for line in err.splitlines() if line.startswith("rankflow:")]
    assert len(lines) == 1 and lines[0].startswith(f"rankflow: run {run_id} is already running: ")
    assert "Traceback" not in err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["run_id"] == run_id and summary["status"] == "already_running" and summary["steps"] == 0


def test_served_deployment_runs_one_at_a_time(prefect_harness, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter
    from prefect.client.schemas.objects import ConcurrencyLimitStrategy
    from prefect.settings import get_current_settings

    config_file = write_config(tmp_path, run={"name": "served"})
    env = client_env(get_current_settings().api.url, tmp_path / "prefect-home")
    server = start(["serve", str(config_file), "--interval", "3600", "--name", "served-limit"], env, tmp_path / "serve")
    try:

        def deployment():
            with get_client(sync_client=True) as client:
                found = client.read_deployments(deployment_filter=DeploymentFilter(name={"any_": ["served-limit"]}))
            return found[0] if found else None

        served = wait_for(deployment, 180, "the served deployment to register")
        assert served.global_concurrency_limit is not None and served.global_concurrency_limit.limit == 1
        assert served.concurrency_options.collision_strategy == ConcurrencyLimitStrategy.CANCEL_NEW
        assert server.poll() is None  # still serving
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
