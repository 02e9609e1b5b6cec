"""The trainer core: everything that runs under torchrun. No Prefect import here.

Public names: the run configuration, the input pre-flight (`validate_inputs`;
every bad-input error is a `BadInputError`), the plan, and the entry points
`trainer_core.run.segment_main` and `trainer_core.run.export_main`. The trainer API
(Trainer, checkpoints, backward state, staleness, transactions) is the
subpackage `trainer_core.training`.

The names are loaded on first use (PEP 562): `import trainer_core.errors` must
not pay for torch and transformers (seconds per process; every committer,
lease holder and CLI start imports a light submodule of this package).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy_exports import lazy_exports

_NAMES_BY_MODULE = {
    "config": ("ConfigError", "RunConfig", "load_config"),
    "data": ("DataError",),
    "errors": ("BadInputError",),
    "run.plan": ("Plan", "SegmentPlan", "build_plan", "read_plan", "write_plan"),
    "run.validate": ("CheckedInputs", "validate_inputs"),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _NAMES_BY_MODULE, globals())

if TYPE_CHECKING:
    from trainer_core.run.plan import Plan, SegmentPlan, build_plan, read_plan, write_plan
    from trainer_core.run.validate import CheckedInputs, validate_inputs

    from .config import ConfigError, RunConfig, load_config
    from .data import DataError
    from .errors import BadInputError
