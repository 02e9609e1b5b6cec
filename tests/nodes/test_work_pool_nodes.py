"""A multi-node segment through a work pool: two node workers, one rendezvous on 127.0.0.1 (real processes).

A Prefect server on PostgreSQL; `rankflow deploy` with train.nnodes = 2
registers the training deployment and the per-node deployment next to it;
three workers, each in a directory of its own, as on three machines: one
serves the pool's default queue (the training flow runs), one queue `node-0`
and one `node-1`. The training run starts one per-node flow run per node;
each runs on the worker of its queue, and the committed weights and losses
are bitwise those of 1 node × 2 processes. The nodes share the run's work dir
(an absolute path, as a shared filesystem would give; the store-backed run
state makes that unnecessary once it lands). Every worker, torchrun and rank
is checked gone at the end.
"""

from __future__ import annotations

import json
import subprocess
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from infra import ledger
from infra.local_process import pick_free_port
from tests.deployments.test_work_pool import (  # noqa: F401 - prefect_server is a fixture
    PREFECT, RANKFLOW, _client_env, _stop_and_check_gone, _wait_for_output, _wait_terminal, _write_config,
    prefect_server,
)
from tests.flows.test_logical_ranks_flow import committed_weights_sha256

pytestmark = [pytest.mark.postgres, pytest.mark.distributed]

_RUN_TIMEOUT_S = 600


@contextmanager
def running_queue_worker(pool: str, queue: str, env: dict[str, str], cwd: Path):
    """`prefect worker start --pool POOL --work-queue QUEUE` in `cwd`; stopped like Ctrl-C, then checked gone."""
    import signal

    cwd.mkdir(parents=True, exist_ok=True)
    log = cwd.parent / f"worker-{queue}.log"
    with log.open("wb") as sink:
        process = subprocess.Popen([PREFECT, "worker", "start", "--pool", pool, "--work-queue", queue],
                                   stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                   start_new_session=True)
    try:
        _wait_for_output(log, "started!", process, 120)
        yield log
    finally:
        _stop_and_check_gone(process, signal.SIGINT, 60, f"the {queue} worker")


def test_two_node_workers_train_a_segment_bitwise_like_one_node_of_two_processes(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    train = {"steps": 2, "steps_per_segment": 2, "logical_dp": 2, "nproc_per_node": 1, "nnodes": 2,
             "rdzv_endpoint": f"127.0.0.1:{pick_free_port()}"}
    config_file = _write_config(tmp_path, train=train)
    env = _client_env(prefect_server.api_url, tmp_path / "client-home")
    deployed_cli = subprocess.run([RANKFLOW, "deploy", str(config_file), "--pool", "nodes-pool", "--name", "two-nodes"],
                                  env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert deployed_cli.returncode == 0, deployed_cli.stderr[-3000:]
    deployed = json.loads(deployed_cli.stdout.strip().splitlines()[-1])

    worker_env = {**env, "PREFECT_WORKER_QUERY_SECONDS": "2"}
    with temporary_settings(updates={PREFECT_API_URL: prefect_server.api_url}), get_client(sync_client=True) as client:
        deployment = client.read_deployment(deployed["deployment_id"])
        assert deployment.parameters["config"]["train"]["node_deployment"] == "rankflow-node/two-nodes"
        node_deployment = client.read_deployment_by_name("rankflow-node/two-nodes")
        assert node_deployment.work_pool_name == "nodes-pool" and node_deployment.global_concurrency_limit is None
        with ExitStack() as workers:
            logs = {queue: workers.enter_context(running_queue_worker("nodes-pool", queue, worker_env, tmp_path / queue))
                    for queue in ("default", "node-0", "node-1")}
            flow_run = client.create_flow_run_from_deployment(deployment.id)
            (finished,) = _wait_terminal(client, [flow_run.id], _RUN_TIMEOUT_S).values()
            assert finished.state.is_completed(), "\n".join(log.read_text()[-4000:] for log in logs.values())
            node_runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                deployment_id=FlowRunFilterDeploymentId(any_=[node_deployment.id])))
        worker_logs = {queue: log.read_text() for queue, log in logs.items()}

    # One run per node, each on its own queue, each run by the worker of that queue only.
    assert sorted((run.work_queue_name, run.state.type.value) for run in node_runs) == [
        ("node-0", "COMPLETED"), ("node-1", "COMPLETED")]
    for run in node_runs:
        assert str(run.id) in worker_logs[run.work_queue_name]
        assert all(str(run.id) not in text for queue, text in worker_logs.items() if queue != run.work_queue_name)

    work_dir = tmp_path / "work"
    (run_id,) = [p.name for p in work_dir.iterdir() if p.is_dir() and p.name.startswith("test-")]
    segments = [e for e in ledger.read(work_dir / run_id) if e["stage"] == "segment" and e["status"] == "completed"]
    deployed_result = (run_id, [loss for e in segments for loss in e["losses"]],
                       committed_weights_sha256(str(tmp_path / "store"), run_id, tmp_path / "download"))

    # The reference: the same config on 1 node × 2 processes, run locally against the same server.
    reference_dir = tmp_path / "reference"
    local = subprocess.run([RANKFLOW, "run", str(config_file), "--set", "train.nnodes=1",
                            "--set", "train.nproc_per_node=2", "--set", f"run.work_dir={reference_dir / 'work'}",
                            "--set", f"storage.url={reference_dir / 'store'}"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=_RUN_TIMEOUT_S)
    assert local.returncode == 0, local.stderr[-3000:]
    summary = json.loads(local.stdout.strip().splitlines()[-1])
    reference = (summary["run_id"], summary["losses"],
                 committed_weights_sha256(str(reference_dir / "store"), summary["run_id"], reference_dir / "download"))
    assert len(deployed_result[1]) == 2
    assert deployed_result == reference
