"""`rankflow serve` builds a scheduled deployment of the training flow with the config as its parameters."""

from __future__ import annotations

from flows.deployment import build_deployment
from trainer_core.config import RunConfig


def test_cron_deployment_carries_schedule_config_and_module_entrypoint(tiny_config):
    deployment = build_deployment(tiny_config, name=None, cron="0 3 * * *", interval_s=None)
    assert deployment.name == "test"
    assert [s.schedule.cron for s in deployment.schedules] == ["0 3 * * *"]
    assert RunConfig.model_validate(deployment.parameters["config"]) == tiny_config
    assert deployment.entrypoint == "flows.pipeline.train_flow"


def test_interval_deployment(tiny_config):
    deployment = build_deployment(tiny_config, name="hourly", cron=None, interval_s=3600)
    assert deployment.name == "hourly"
    assert [s.schedule.interval.total_seconds() for s in deployment.schedules] == [3600]
