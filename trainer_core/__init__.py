"""The trainer core: everything that runs under torchrun. No Prefect import here.

Public names: the run configuration, the input pre-flight (`validate_inputs`;
every bad-input error is a `BadInputError`), the plan, and the entry points
`trainer_core.segment_main` and `trainer_core.export_main`.
"""

from .config import ConfigError, RunConfig, load_config
from .data import DataError
from .errors import BadInputError
from .plan import Plan, SegmentPlan, build_plan, read_plan, write_plan
from .validate import CheckedInputs, validate_inputs

__all__ = ["BadInputError", "CheckedInputs", "ConfigError", "DataError", "Plan", "RunConfig", "SegmentPlan", "build_plan",
           "load_config", "read_plan", "validate_inputs", "write_plan"]
