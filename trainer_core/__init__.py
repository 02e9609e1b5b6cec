"""The trainer core: everything that runs under torchrun. No Prefect import here.

Public names: the run configuration, the input pre-flight (`validate_inputs`;
every bad-input error is a `BadInputError`), the plan, and the entry points
`trainer_core.segment_main` and `trainer_core.export_main`. The trainer API
(Trainer, checkpoints, backward state, staleness, transactions) is the
subpackage `trainer_core.training`.

The names are loaded on first use (PEP 562): `import trainer_core.errors` must
not pay for torch and transformers (seconds per process; every committer,
lease holder and CLI start imports a light submodule of this package).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "ConfigError": "config", "RunConfig": "config", "load_config": "config",
    "DataError": "data",
    "BadInputError": "errors",
    "Plan": "plan", "SegmentPlan": "plan", "build_plan": "plan", "read_plan": "plan", "write_plan": "plan",
    "CheckedInputs": "validate", "validate_inputs": "validate",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .config import ConfigError, RunConfig, load_config
    from .data import DataError
    from .errors import BadInputError
    from .plan import Plan, SegmentPlan, build_plan, read_plan, write_plan
    from .validate import CheckedInputs, validate_inputs


def __getattr__(name: str):
    """Import the submodule that defines `name` (or the submodule `name` itself) on first access."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
