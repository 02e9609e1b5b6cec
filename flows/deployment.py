"""Serve the training flow as a Prefect deployment on a schedule.

Scheduled runs appear in the Prefect UI of the server named by
`PREFECT_API_URL` (start one with `rankflow ui`). Each scheduled run trains the
same config; since the run id comes from the plan digest, a later run of
unchanged inputs resumes and re-publishes the same run instead of retraining.

One run at a time: the deployment has a concurrency limit of 1 with
CANCEL_NEW (`ONE_RUN_AT_A_TIME`, as `rankflow deploy` sets), so a tick that
fires while a run trains is cancelled instead of queued; the run lease
(infra/runs/run_lease.py) guards the same run id against runs started any other way.
"""

from __future__ import annotations

from prefect.deployments.runner import RunnerDeployment
from prefect.types.entrypoint import EntrypointType

from trainer_core.config import RunConfig

from .deploy import ONE_RUN_AT_A_TIME
from .pipeline import train_flow


def build_deployment(
    config: RunConfig, *, name: str | None, cron: str | None, interval_s: float | None
) -> RunnerDeployment:
    deployment = train_flow.to_deployment(
        name=name or config.run.name,
        cron=cron,
        interval=interval_s,
        parameters={"config": config.model_dump(mode="json")},
        description=f"rankflow training run {config.run.name}",
        tags=["rankflow"],
        concurrency_limit=ONE_RUN_AT_A_TIME,
        # The installed module, not a file path: runs start from any directory.
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    # Prefect types to_deployment as "deployment or coroutine" (async_dispatch); from sync code it
    # runs the sync implementation, so this is the deployment.
    assert isinstance(deployment, RunnerDeployment)
    return deployment


def serve_deployment(config: RunConfig, *, name: str | None, cron: str | None, interval_s: float | None) -> None:
    from prefect import serve

    serve(build_deployment(config, name=name, cron=cron, interval_s=interval_s))
