"""A Prefect server on PostgreSQL, a process work pool and a worker run the deployed tiny job (real processes).

The user's commands, as subprocesses on loopback: `rankflow server` on the
session's PostgreSQL, `rankflow deploy CONFIG --pool NAME`, and `prefect
worker start --pool NAME` in another directory with only the store's AWS_*
variables and PREFECT_API_URL. The run is checked through the API (state,
artifacts, the concurrency limit), in PostgreSQL's own tables, and in
SeaweedFS (a committed checkpoint whose every file verifies). Every process
is stopped at teardown and checked gone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from infra.publication.checkpoints import download_checkpoint, latest_checkpoint
from infra.services.local_process import pick_free_port
from infra.store import open_store
from tests.conftest import tiny_tree
from tests.e2e.deployments.prefect_server import (
    GONE_S,
    PREFECT,
    RANKFLOW,
    client_env,
    start_rankflow_server,
    stop_and_check_gone,
    wait_for_output,
    wait_terminal,
    write_config,
)

pytestmark = [pytest.mark.postgres]

_RUN_TIMEOUT_S = 400
_FIRST_STEP = re.compile(r"\] step 0 loss ")


@contextmanager
def running_worker(pool: str, env: dict[str, str], cwd: Path) -> Iterator[Path]:
    """`prefect worker start --pool POOL` as a user starts it; stopped like Ctrl-C, then checked gone."""
    cwd.mkdir(parents=True, exist_ok=True)
    log = cwd.parent / f"worker-{pool}.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [PREFECT, "worker", "start", "--pool", pool],
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
    try:
        wait_for_output(log, "started!", process, 120)
        yield log
    finally:
        stop_and_check_gone(process, signal.SIGINT, GONE_S, "the worker")


def _first_step_latency(client, flow_run) -> dict:
    """Seconds from the run's creation to the worker's pick-up, the flow's start and the first optimizer step."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    states = client.read_flow_run_states(flow_run.id)
    first = {}
    for state in sorted(states, key=lambda s: s.timestamp):
        first.setdefault(state.type.value, state.timestamp)
    logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id])), sort=LogSort.TIMESTAMP_ASC)
    step_logs = [log.timestamp for log in logs if _FIRST_STEP.search(log.message)]
    assert step_logs, "the trainer's step lines did not reach the run's logs"
    created = flow_run.created
    return {
        "created_to_pending_s": (first["PENDING"] - created).total_seconds(),
        "pending_to_running_s": (first["RUNNING"] - first["PENDING"]).total_seconds(),
        "running_to_first_step_s": (step_logs[0] - first["RUNNING"]).total_seconds(),
        "created_to_first_step_s": (step_logs[0] - created).total_seconds(),
        "created_to_completed_s": (first["COMPLETED"] - created).total_seconds(),
    }


def _state_in_postgres(cluster, flow_run_id) -> str:
    import asyncio

    import asyncpg

    async def query() -> str:
        connection = await asyncpg.connect(
            host=cluster.host,
            port=cluster.port,
            user=cluster.user,
            password=cluster.password,
            database=cluster.database,
        )
        try:
            return await connection.fetchval("SELECT state_type FROM flow_run WHERE id = $1", flow_run_id)
        finally:
            await connection.close()

    return asyncio.run(query())


@pytest.mark.s3
def test_deployed_tiny_job_runs_on_a_worker_and_commits_to_s3(
    prefect_server, postgres_cluster, s3_env, s3_bucket_url, tmp_path, record_property
):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.client.schemas.objects import ConcurrencyLimitStrategy
    from prefect.settings import PREFECT_API_URL, temporary_settings

    work_dir = tmp_path / "worker-work"  # the worker's, absolute; the deployer never touches it
    config_file = write_config(tmp_path, storage={"url": s3_bucket_url}, run={"work_dir": str(work_dir)})
    deployer_dir = tmp_path / "deployer"
    deployer_dir.mkdir()
    deployed_cli = subprocess.run(
        [RANKFLOW, "deploy", str(config_file), "--pool", "tiny-pool", "--name", "tiny"],
        env=client_env(prefect_server.api_url, tmp_path / "deployer-home"),
        cwd=deployer_dir,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert deployed_cli.returncode == 0, deployed_cli.stderr[-3000:]
    deployed = json.loads(deployed_cli.stdout.strip().splitlines()[-1])
    assert deployed["worker_command"] == "prefect worker start --pool tiny-pool"
    assert deployed["deployment"] == "rankflow-train/tiny" and deployed["work_pool_type"] == "process"
    assert list(deployer_dir.iterdir()) == [] and not work_dir.exists()  # deploying writes nothing

    with temporary_settings(updates={PREFECT_API_URL: prefect_server.api_url}), get_client(sync_client=True) as client:
        deployment = client.read_deployment(deployed["deployment_id"])
        assert deployment.work_pool_name == "tiny-pool" and deployment.entrypoint == "flows.pipeline.train_flow"
        assert deployment.parameters["config"]["storage"]["url"] == s3_bucket_url
        assert deployment.global_concurrency_limit.limit == 1
        assert deployment.concurrency_options.collision_strategy == ConcurrencyLimitStrategy.CANCEL_NEW
        assert client.read_work_pool("tiny-pool").type == "process"

        worker_env = client_env(prefect_server.api_url, tmp_path / "worker-home")
        worker_env["PREFECT_WORKER_QUERY_SECONDS"] = "2"  # default 10: up to 8 s more before a run is picked up
        with running_worker("tiny-pool", worker_env, tmp_path / "worker-cwd") as worker_log:
            # Two runs at once: the deployment's limit of 1 cancels the one that comes second.
            flow_runs = [client.create_flow_run_from_deployment(deployment.id) for _ in range(2)]
            runs = wait_terminal(client, [run.id for run in flow_runs], _RUN_TIMEOUT_S)
        states = sorted(run.state.type.value for run in runs.values())
        assert states == ["CANCELLED", "COMPLETED"], worker_log.read_text()[-5000:]
        (completed,) = [run for run in runs.values() if run.state.is_completed()]
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[completed.id]))
        )
        latency = _first_step_latency(client, completed)

    keys = sorted(artifact.key for artifact in artifacts)
    # The run's notes: the committed checkpoint, the live metrics and progress views, the segment table.
    assert [key.rsplit("-", 1)[-1] for key in keys] == ["checkpoint", "metrics", "progress", "segments"], keys
    (checkpoint_note,) = [a for a in artifacts if a.key.endswith("-checkpoint")]
    assert s3_bucket_url in checkpoint_note.data

    # The run is in PostgreSQL's tables, not in some SQLite file of the server's.
    assert _state_in_postgres(postgres_cluster, completed.id) == "COMPLETED"

    # The checkpoint is committed in SeaweedFS and every file verifies; the worker used the configured work dir.
    store = open_store(s3_bucket_url)
    (run_id,) = [path.rstrip("/").rsplit("/", 1)[-1] for path in store.fs.ls(store.path(), detail=False)]
    assert keys[0] == f"{run_id.lower()}-checkpoint"
    name = latest_checkpoint(store, run_id)
    assert name == "step-00000006"
    assert (download_checkpoint(store, run_id, name, tmp_path / "download") / "config.json").is_file()
    assert (work_dir / run_id).is_dir()

    record_property("deployment_latency", latency)
    print(f"\ndeployment run -> first step through a worker: {json.dumps(latency)}")


def test_redeploy_updates_the_deployment_in_place(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.deploy import deploy_training
    from trainer_core.config import config_from_dict

    config = config_from_dict(tiny_tree(tmp_path), config_dir=tmp_path)
    with temporary_settings(updates={PREFECT_API_URL: prefect_server.api_url}), get_client(sync_client=True) as client:
        first = deploy_training(config, pool="redeploy-pool", name="nightly", cron="0 3 * * *")
        config.train.steps = 9
        second = deploy_training(
            config,
            pool="redeploy-pool",
            name="nightly",
            cron="30 4 * * *",
            job_variables={"working_dir": str(tmp_path)},
        )
        deployment = client.read_deployment(second.deployment_id)
    assert second.deployment_id == first.deployment_id
    assert [schedule.schedule.cron for schedule in deployment.schedules] == ["30 4 * * *"]
    assert deployment.parameters["config"]["train"]["steps"] == 9
    assert deployment.job_variables == {"working_dir": str(tmp_path)}


def test_the_servers_ui_calls_the_api_on_the_servers_own_port(prefect_server):
    """The UI's pages read their API address from /ui-settings: `--port` must reach it (it said :4200)."""
    with urllib.request.urlopen(prefect_server.api_url.removesuffix("/api") + "/ui-settings", timeout=120) as response:
        settings = json.loads(response.read())
    assert settings["api_url"] == prefect_server.api_url


def test_rankflow_server_with_its_own_cluster_stops_everything_on_ctrl_c(postgres_cluster, tmp_path_factory):
    del postgres_cluster  # only for its skip (or CI failure) where PostgreSQL is not installed
    import shutil
    import tempfile
    import urllib.request

    # As root PostgreSQL runs as another user, who must be able to enter the directory's parents.
    base = Path(tempfile.mkdtemp(prefix="rankflow-server-"))
    os.chmod(base, 0o755)
    try:
        pg_dir, logs = base / "pg", tmp_path_factory.mktemp("own-cluster")
        port = pick_free_port()
        env = client_env("unused", logs / "home")
        for name in (
            "PREFECT_API_URL",
            "PREFECT_API_DATABASE_CONNECTION_URL",
            "PREFECT_SERVER_DATABASE_CONNECTION_URL",
        ):
            env.pop(name, None)
        process, output = start_rankflow_server(["--port", str(port), "--pg-dir", str(pg_dir)], env, logs)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=120) as response:
                assert response.status == 200
            password = (pg_dir / "password").read_text().strip()
            assert "postgresql+asyncpg://rankflow:***@127.0.0.1:" in output.read_text()
            assert password not in output.read_text() and password not in (logs / "server.log").read_text()
        finally:
            exit_code = stop_and_check_gone(process, signal.SIGINT, GONE_S, "rankflow server --pg-dir")
        assert exit_code == 0, output.read_text()[-3000:]
        assert "database system is shut down" in (pg_dir / "postgres.log").read_text()
        assert (pg_dir / "pgdata" / "PG_VERSION").is_file()  # kept for the next start
    finally:
        shutil.rmtree(base, ignore_errors=True)
