"""A multi-node segment through a work pool: two node workers, one rendezvous on 127.0.0.1 (real processes).

A Prefect server on PostgreSQL; `rankflow deploy` with train.nnodes = 2
registers the training deployment and the per-node deployment next to it;
three workers, each in a directory of its own, as on three machines: one
serves the pool's default queue (the training flow runs), one queue `node-0`
and one `node-1`, each node worker with a work dir of its own
(`RANKFLOW_NODE_WORK_DIR`), none of them the training flow's. The training run
starts one per-node flow run per node; each runs on the worker of its queue,
fetches its inputs from the store, finds node 0 through the endpoint node 0
published in the store (no `train.rdzv_endpoint`), and the node holding
global rank 0 uploads the state; the committed weights and losses are bitwise
those of 1 node × 2 processes. A rank killed on one node fails both node runs
of that attempt, every process of it is gone before the retry's first one
starts, and the retried segment ends bitwise equal. A node queue no worker
serves fails the attempt naming the queue. Every worker, torchrun and rank is
checked gone at the end. One deployed run of 2 segments serves the first two
tests: its first segment trains undisturbed, its second is killed once and
retried; one local 1 node × 2 processes run is their reference.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from flows.node import NODE_ADDRESS_ENV, NODE_WORK_DIR_ENV
from infra.runs import ledger
from tests.e2e.deployments.prefect_server import (
    PREFECT,
    RANKFLOW,
    client_env,
    stop_and_check_gone,
    wait_for_output,
    wait_terminal,
    write_config,
)
from tests.e2e.flows.test_logical_ranks_flow import committed_weights_sha256
from trainer_core.run.faults import FAULT_ENV, FAULT_KIND_ENV

pytestmark = [pytest.mark.postgres, pytest.mark.distributed]

_RUN_TIMEOUT_S = 600


@contextmanager
def running_queue_worker(pool: str, queue: str, env: dict[str, str], cwd: Path):
    """`prefect worker start --pool POOL --work-queue QUEUE` in `cwd`; stopped like Ctrl-C, then checked gone."""
    import signal

    cwd.mkdir(parents=True, exist_ok=True)
    log = cwd.parent / f"worker-{queue}.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [PREFECT, "worker", "start", "--pool", pool, "--work-queue", queue],
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
        stop_and_check_gone(process, signal.SIGINT, 60, f"the {queue} worker")


FAULT_STEP = 3
"""The node workers carry a one-time SIGKILL of rank 1 at this step: only the 4-step run reaches it."""


@dataclass(frozen=True)
class NodePool:
    api_url: str
    env: dict
    logs: dict
    fault_marker: Path
    node_work_dirs: dict[str, Path]


def _deploy(config_file: Path, name: str, env: dict, cwd: Path) -> dict:
    deployed_cli = subprocess.run(
        [RANKFLOW, "deploy", str(config_file), "--pool", "nodes-pool", "--name", name],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert deployed_cli.returncode == 0, deployed_cli.stderr[-3000:]
    return json.loads(deployed_cli.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def node_pool(prefect_server, tmp_path_factory) -> Iterator[NodePool]:
    """Three workers of `nodes-pool`, each in its own directory: the default queue, node-0 and node-1."""
    base = tmp_path_factory.mktemp("node-pool")
    env = client_env(prefect_server.api_url, base / "client-home")
    marker = base / "fault-happened"
    worker_env = {
        **env,
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        FAULT_ENV: f"{FAULT_STEP}:1:{marker}",
        FAULT_KIND_ENV: "kill",
    }
    # As on separate machines: each node worker keeps the runs under a work dir of its own.
    node_work_dirs = {queue: base / f"{queue}-work" for queue in ("node-0", "node-1")}
    queue_env = {
        "default": worker_env,
        **{
            queue: {**worker_env, NODE_WORK_DIR_ENV: str(work), NODE_ADDRESS_ENV: "127.0.0.1"}
            for queue, work in node_work_dirs.items()
        },
    }
    with ExitStack() as workers:
        logs = {
            queue: workers.enter_context(running_queue_worker("nodes-pool", queue, env_of, base / queue))
            for queue, env_of in queue_env.items()
        }
        yield NodePool(prefect_server.api_url, env, logs, marker, node_work_dirs)


def _run_deployed(pool: NodePool, tmp_path: Path, steps: int, name: str):
    """Deploy the tiny job at 2 nodes × 1 process, run it on the workers; returns (flow run, node runs, result)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    train = {
        "steps": steps,
        "steps_per_segment": 2,
        "logical_dp": 2,
        "nproc_per_node": 1,
        "nnodes": 2,
    }
    config_file = write_config(tmp_path, train=train)
    deployed = _deploy(config_file, name, pool.env, tmp_path)
    with temporary_settings(updates={PREFECT_API_URL: pool.api_url}), get_client(sync_client=True) as client:
        deployment = client.read_deployment(deployed["deployment_id"])
        assert deployment.parameters["config"]["train"]["node_deployment"] == f"rankflow-node/{name}"
        node_deployment = client.read_deployment_by_name(f"rankflow-node/{name}")
        assert node_deployment.work_pool_name == "nodes-pool" and node_deployment.global_concurrency_limit is None
        flow_run = client.create_flow_run_from_deployment(deployment.id)
        (finished,) = wait_terminal(client, [flow_run.id], _RUN_TIMEOUT_S).values()
        assert finished.state.is_completed(), "\n".join(log.read_text()[-4000:] for log in pool.logs.values())
        node_runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[node_deployment.id]))
        )
    work_dir = tmp_path / "work"
    (run_id,) = [p.name for p in work_dir.iterdir() if p.is_dir() and p.name.startswith("test-")]
    entries = ledger.read(work_dir / run_id)
    segments = [e for e in entries if e["stage"] == "segment" and e["status"] == "completed"]
    result = (
        run_id,
        [loss for e in segments for loss in e["losses"]],
        committed_weights_sha256(str(tmp_path / "store"), run_id, tmp_path / "download"),
    )
    return config_file, node_runs, entries, result


def _reference(pool: NodePool, config_file: Path, base: Path) -> tuple:
    """The same config on 1 node × 2 processes, run locally (`rankflow run`) against the same server."""
    local = subprocess.run(
        [
            RANKFLOW,
            "run",
            str(config_file),
            "--set",
            "train.nnodes=1",
            "--set",
            "train.nproc_per_node=2",
            "--set",
            f"run.work_dir={base / 'work'}",
            "--set",
            f"storage.url={base / 'store'}",
        ],
        env=pool.env,
        cwd=base.parent,
        capture_output=True,
        text=True,
        timeout=_RUN_TIMEOUT_S,
    )
    assert local.returncode == 0, local.stderr[-3000:]
    summary = json.loads(local.stdout.strip().splitlines()[-1])
    return (
        summary["run_id"],
        summary["losses"],
        committed_weights_sha256(str(base / "store"), summary["run_id"], base / "download"),
    )


@dataclass(frozen=True)
class KilledNodeRun:
    tmp_path: Path
    node_runs: list
    entries: list
    result: tuple
    reference: tuple
    sampler: object


@pytest.fixture(scope="module")
def killed_node_run(node_pool, tmp_path_factory) -> KilledNodeRun:
    """4 steps in 2 segments on the node workers (rank 1 SIGKILLed once, at step 3), and the local reference."""
    from tests.e2e.nodes.test_local_nodes import AttemptSampler

    tmp_path = tmp_path_factory.mktemp("killed-node")
    with AttemptSampler() as sampler:  # the workers are this process's children: their flow runs' torchruns too
        config_file, node_runs, entries, result = _run_deployed(node_pool, tmp_path, steps=4, name="killed-node")
    reference = _reference(node_pool, config_file, tmp_path / "reference")
    return KilledNodeRun(tmp_path, node_runs, entries, result, reference, sampler)


def test_two_node_workers_train_a_segment_bitwise_like_one_node_of_two_processes(node_pool, killed_node_run):
    run = killed_node_run
    worker_logs = {queue: log.read_text() for queue, log in node_pool.logs.items()}
    # Segment 0, undisturbed: one run per node, each on its own queue, each run by the worker of that queue only.
    segment_0 = [node_run for node_run in run.node_runs if " segment-0 " in node_run.name]
    assert sorted((node_run.work_queue_name, node_run.state.type.value) for node_run in segment_0) == [
        ("node-0", "COMPLETED"),
        ("node-1", "COMPLETED"),
    ]
    for node_run in run.node_runs:
        assert str(node_run.id) in worker_logs[node_run.work_queue_name]
        assert all(str(node_run.id) not in text for q, text in worker_logs.items() if q != node_run.work_queue_name)
    assert len(run.result[1]) == 4
    _prefect_got_the_readable_lines_and_the_files_every_line(node_pool, segment_0, run.result[0])
    assert run.result == run.reference


def test_a_killed_node_fails_both_node_runs_and_the_retried_segment_ends_bitwise_equal(node_pool, killed_node_run):
    run, sampler = killed_node_run, killed_node_run.sampler
    assert node_pool.fault_marker.is_file()
    # Segment 1's first attempt: both node runs ended (one failed, the other failed or was cancelled); its retry's
    # two node runs completed. Every process of the failed attempt was gone before the retry's first one started.
    segment_1 = sorted((node_run.state.type.value for node_run in run.node_runs if "segment-1" in node_run.name))
    assert len(segment_1) == 4 and segment_1.count("COMPLETED") == 2, [(r.name, r.state_name) for r in run.node_runs]
    assert set(segment_1) - {"COMPLETED"} <= {"FAILED", "CANCELLED", "CRASHED"}
    assert len(sampler.order) == 2 and len(sampler.pids[sampler.order[0]]) >= 4, sampler.pids
    assert sampler.overlaps == []
    failures = [e for e in run.entries if e["stage"] == "segment" and e["status"] == "failed"]
    assert len(failures) == 1 and failures[0]["segment"] == 1, failures
    assert failures[0]["failure"]["cause"] in ("rank_died", "collective_timeout"), failures[0]
    assert len(run.result[1]) == 4
    _nodes_moved_their_files(node_pool, run.tmp_path, run.result[0], num_segments=2)
    assert run.result == run.reference


def _nodes_moved_their_files(pool: NodePool, tmp_path: Path, run_id: str, num_segments: int) -> None:
    """Each node fetched its inputs into its own work dir; the state went through the store, and so did the logs."""
    orchestrator = tmp_path / "work" / run_id
    store = tmp_path / "store" / run_id
    holders = []
    for queue, work in pool.node_work_dirs.items():
        run_dir = work / run_id
        assert (run_dir / "plan.json").read_bytes() == (store / "plan.json").read_bytes()  # fetched, verified
        holders.append({s for s in range(num_segments) if (run_dir / "segments" / f"segment-{s:04d}.json").is_file()})
        for log in (p for p in (run_dir / "logs").rglob("*") if p.is_file()):
            assert (store / log.relative_to(run_dir)).read_bytes() == log.read_bytes(), log
        assert any((run_dir / "logs").rglob("torchrun.log")), queue
    # One node held global rank 0 in each segment and stored its state; the training flow stored none.
    assert sorted(s for held in holders for s in held) == list(range(num_segments)), holders
    stored = [
        e["segment"]
        for work in pool.node_work_dirs.values()
        for e in ledger.read(work / run_id)
        if e["stage"] == "run-state" and e["status"] == "stored"
    ]
    assert sorted(stored) == list(range(num_segments)), stored
    assert not [
        e for e in ledger.read(orchestrator) if e["stage"] == "run-state" and e["status"] == "stored" and "segment" in e
    ]
    assert not (store / "rendezvous").exists() or not any((store / "rendezvous").iterdir())  # each notice withdrawn


def _prefect_got_the_readable_lines_and_the_files_every_line(pool: NodePool, node_runs, run_id: str) -> None:
    """Prefect's log rows of one segment's node runs (2 steps in well under 30 s): rank 0's first step line only, no
    ordinary line of another rank; the rank log files (their copies in the store are compared) hold every line."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: pool.api_url}), get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id for run in node_runs])))
    rows = [(log.level, log.message) for log in logs if log.message.startswith("[rank ")]
    files = "".join(
        p.read_text() for work in pool.node_work_dirs.values() for p in (work / run_id / "logs").rglob("std*.log")
    )
    steps = [message for _, message in rows if message.startswith("[rank 0] step ")]
    assert len(steps) == 1 and steps[0].startswith("[rank 0] step 0 "), rows
    assert "[rank 0] step 1 loss" in files  # kept in the files, not sent
    assert any(message.startswith("[rank 0] segment 0 done") for _, message in rows)
    assert all(level >= 30 for level, message in rows if not message.startswith("[rank 0] ")), rows
    assert all(message in files for _, message in rows)


def test_a_node_queue_no_worker_serves_fails_the_attempt_naming_it(node_pool, tmp_path):
    """A pool whose queues no worker polls: the node runs are cancelled and the error names the queue and the fix."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.deploy import deploy_node_flow
    from tasks.nodes import NodeFailed
    from tasks.nodes.queue_liveness import silent_queue_problem
    from tasks.nodes.work_pool import launch_deployed_nodes
    from tasks.outcomes import PlannedRun
    from trainer_core.config import StorageSection, TrainSection

    with temporary_settings(updates={PREFECT_API_URL: node_pool.api_url}), get_client(sync_client=True) as client:
        # The live workers' queues are served (their polls are read back from the server).
        assert silent_queue_problem(client, "nodes-pool", "node-1") is None
        deployed = deploy_node_flow(pool="idle-pool", name="idle")
        planned = PlannedRun(
            run_id="idle-0123456789ab",
            digest="d",
            run_dir=str(tmp_path / "work"),
            segment_steps=[(0, 1)],
            train=TrainSection(nnodes=2, nproc_per_node=1, logical_dp=2, node_deployment=deployed.full_name),
            storage=StorageSection(url=str(tmp_path / "store")),
        )
        started = time.monotonic()
        with pytest.raises(
            NodeFailed, match=r"no live worker serves work queue 'node-0' of pool 'idle-pool'"
        ) as failed:
            launch_deployed_nodes(planned, 0, "idle-rdzv", "A", lambda: None, queue_silence_s=3)
        # Told within seconds (3 s of silence), not at the launch timeout (minutes): bounded generously for load.
        assert time.monotonic() - started < 120
        assert "prefect worker start --pool idle-pool --work-queue node-0" in str(failed.value)
        assert failed.value.failure is not None and failed.value.failure.cause.value == "launch_timeout"
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[deployed.deployment_id]))
        )
        assert sorted(run.state_name for run in runs) == ["Cancelled", "Cancelled"]
