"""Training objectives as registered classes: `train.objective` names one of `OBJECTIVES`.

`SFT` (the loss on assistant tokens) and `ClippedPolicyGradient` (the clipped
surrogate on RL trajectories); the protocol is `trainer_core.objectives.base.Objective`.
Unset, `train.objective` follows `data.kind` (`trainer_core.data_kinds`). The
config's choices are the torch-free `trainer_core.registry_names.OBJECTIVE_NEEDS`,
checked here against the classes. The loss functions stay importable from here.
"""

from __future__ import annotations

from ..registry_names import OBJECTIVE_NEEDS, check_names
from .base import LiveColumn, LossSum, Objective
from .policy_gradient import (
    ClippedPolicyGradient,
    PolicyGradientStats,
    clipped_policy_gradient_sum,
    count_documents,
    stale_trajectory_mask,
)
from .sft import SFT, sft_loss_sum

OBJECTIVES: dict[str, type[Objective]] = {cls.name: cls for cls in (SFT, ClippedPolicyGradient)}
"""Every objective by its `train.objective` name."""
check_names("train.objective", OBJECTIVE_NEEDS, {name: cls.needs for name, cls in OBJECTIVES.items()})

__all__ = [
    "OBJECTIVES",
    "ClippedPolicyGradient",
    "LiveColumn",
    "LossSum",
    "Objective",
    "PolicyGradientStats",
    "SFT",
    "clipped_policy_gradient_sum",
    "count_documents",
    "objective_for",
    "sft_loss_sum",
    "stale_trajectory_mask",
]


def objective_for(config) -> Objective:
    """The configured objective, built from its settings."""
    return OBJECTIVES[config.train.objective].from_config(config)
