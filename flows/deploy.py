"""Deployments of rankflow's flows to a Prefect work pool, run by workers on any machine.

`deploy_flow` is the reusable step: it creates the work pool when missing (a
process pool; an existing pool of any type, e.g. Kubernetes, is used as it is)
and creates or updates a deployment of a flow on it, entrypoint by module path
so a worker imports the installed `rankflow` package from whatever directory
it runs in, with no image build and no code upload. `deploy_training` deploys
the training flow with a run config as its parameters; `rankflow deploy` is
its command line.

A worker (`prefect worker start --pool NAME`, on a machine with rankflow
installed and the store's credentials in its environment) polls the pool and
runs each flow run in a subprocess. Credentials never go into a deployment:
they would be stored in the server's database and shown in its UI.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prefect import Flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy, WorkPool
from prefect.deployments.runner import RunnerDeployment
from prefect.exceptions import ObjectNotFound
from prefect.types.entrypoint import EntrypointType
from prefect.workers.process import ProcessWorker

from trainer_core.config import RunConfig

__all__ = [
    "Deployed",
    "ONE_RUN_AT_A_TIME",
    "deploy_flow",
    "deploy_node_flow",
    "deploy_training",
    "ensure_work_pool",
    "worker_command",
]

ONE_RUN_AT_A_TIME = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW)
"""A run that would start while another run of the same deployment is active is cancelled, not queued.

Two runs of one config share a run id (it comes from the plan digest) and its
work dir: side by side they would train the same segments twice and race to
publish them. A schedule that fires while a long run trains skips that slot
instead of piling runs up behind it.
"""


@dataclass(frozen=True)
class Deployed:
    """A deployment registered on the API, and how to run it."""

    deployment_id: str
    full_name: str
    """`FLOW/DEPLOYMENT`, what `prefect deployment run` and `run_deployment` take."""
    work_pool: str
    work_pool_type: str
    work_queue: str | None

    @property
    def worker_command(self) -> str:
        return worker_command(self.work_pool, self.work_queue)

    def as_dict(self) -> dict[str, Any]:
        return {
            "deployment_id": self.deployment_id,
            "deployment": self.full_name,
            "work_pool": self.work_pool,
            "work_pool_type": self.work_pool_type,
            "work_queue": self.work_queue,
            "worker_command": self.worker_command,
            "run_command": f"prefect deployment run {shlex.quote(self.full_name)}",
        }


def worker_command(pool: str, work_queue: str | None = None) -> str:
    """The command that starts a worker for `pool` (and only `work_queue`, when given)."""
    command = ["prefect", "worker", "start", "--pool", pool]
    if work_queue is not None:
        command += ["--work-queue", work_queue]
    return shlex.join(command)


def ensure_work_pool(name: str) -> WorkPool:
    """The work pool `name`; created as a process pool with Prefect's default job template if missing.

    An existing pool is used as it is, whatever its type: a Kubernetes pool is
    made with `prefect work-pool create NAME --type kubernetes` and its own
    base job template (README: "Kubernetes work pool").
    """
    with get_client(sync_client=True) as client:
        try:
            return client.read_work_pool(name)
        except ObjectNotFound:
            pass
        template = ProcessWorker.get_default_base_job_template()
        return client.create_work_pool(WorkPoolCreate(name=name, type=ProcessWorker.type, base_job_template=template))


def deploy_flow(
    flow: Flow,
    *,
    name: str,
    pool: str,
    parameters: dict[str, Any],
    work_queue: str | None = None,
    job_variables: dict[str, Any] | None = None,
    cron: str | None = None,
    interval_s: float | None = None,
    tags: Iterable[str] = (),
    description: str | None = None,
    concurrency_limit: ConcurrencyLimitConfig | None = ONE_RUN_AT_A_TIME,
) -> Deployed:
    """Create or update deployment `name` of `flow` on work pool `pool` (created as a process pool if missing).

    Re-deploying the same name updates it in place (parameters, schedule,
    pool), so a config change is a re-deploy, not a new deployment.
    """
    work_pool = ensure_work_pool(pool)
    deployment = flow.to_deployment(
        name=name,
        cron=cron,
        interval=interval_s,
        parameters=parameters,
        description=description,
        tags=list(tags),
        work_pool_name=work_pool.name,
        work_queue_name=work_queue,
        job_variables=dict(job_variables or {}),
        concurrency_limit=concurrency_limit,
        # The installed module, not a file path: a worker runs it from any directory.
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    # Prefect types to_deployment as "deployment or coroutine" (async_dispatch); from sync code it
    # runs the sync implementation, so this is the deployment.
    assert isinstance(deployment, RunnerDeployment)
    deployment_id = deployment.apply()
    return Deployed(
        deployment_id=str(deployment_id),
        full_name=f"{flow.name}/{name}",
        work_pool=work_pool.name,
        work_pool_type=work_pool.type,
        work_queue=work_queue,
    )


def deploy_node_flow(*, pool: str, name: str, job_variables: dict[str, Any] | None = None) -> Deployed:
    """Deploy the per-node flow (`flows.node`) on `pool`: node K's runs go to its queue `node-K`.

    No concurrency limit: every node of a segment runs at the same time.
    """
    from .node import node_flow

    return deploy_flow(
        node_flow,
        name=name,
        pool=pool,
        parameters={},
        job_variables=job_variables,
        tags=["rankflow", "rankflow-node"],
        concurrency_limit=None,
        description="one node's torchrun of a multi-node rankflow segment; workers serve queue node-K",
    )


def deploy_training(
    config: RunConfig,
    *,
    pool: str,
    name: str | None = None,
    work_queue: str | None = None,
    job_variables: dict[str, Any] | None = None,
    cron: str | None = None,
    interval_s: float | None = None,
) -> Deployed:
    """Deploy the training flow with `config` (paths already absolute) as its parameters.

    With train.nnodes > 1 the per-node flow is deployed alongside, under the
    same name, and the config names it (train.node_deployment) unless it names
    one already.
    """
    from .pipeline import train_flow

    if config.train.nnodes > 1 and config.train.node_deployment is None:
        config = config.model_copy(deep=True)
        node_deployment = deploy_node_flow(pool=pool, name=name or config.run.name, job_variables=job_variables)
        config.train.node_deployment = node_deployment.full_name

    return deploy_flow(
        train_flow,
        name=name or config.run.name,
        pool=pool,
        parameters={"config": config.model_dump(mode="json")},
        work_queue=work_queue,
        job_variables=job_variables,
        cron=cron,
        interval_s=interval_s,
        tags=["rankflow", f"run:{config.run.name}"],
        description=(
            f"rankflow training run {config.run.name}: store {config.storage.url}, "
            f"work dir {config.run.work_dir} on the worker"
        ),
    )
