"""A run planned as the plan stage plans it (without Prefect), for tests that drive segments in this process."""

from __future__ import annotations

from pathlib import Path

from trainer_core.config import RunConfig
from trainer_core.run.plan import build_plan, run_dir_for, write_plan


def planned_run_dir(config: RunConfig) -> Path:
    """Build `config`'s plan and write it (plan.json and the shards) into its run directory; that directory."""
    plan, shards = build_plan(config)
    run_dir = run_dir_for(config, plan.run_id)
    write_plan(plan, shards, run_dir)
    return run_dir
