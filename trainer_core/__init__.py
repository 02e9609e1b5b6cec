"""The trainer core: everything that runs under torchrun. No Prefect import here.

Public names: the run configuration, the plan, and the entry points
`trainer_core.segment_main` and `trainer_core.export_main`. The trainer API
(Trainer, checkpoints, backward state, staleness, transactions) is the
subpackage `trainer_core.training`.
"""

from .config import ConfigError, RunConfig, load_config
from .data import DataError
from .plan import Plan, SegmentPlan, build_plan, read_plan, write_plan

__all__ = ["ConfigError", "DataError", "Plan", "RunConfig", "SegmentPlan", "build_plan", "load_config", "read_plan", "write_plan"]
