"""Training objectives on managed logprobs: SFT and the token-level clipped policy gradient.

Both return *sums* over loss tokens; the caller divides by the number of loss
tokens in the whole global batch, so the loss does not depend on how the batch
is split over ranks (token-level normalisation, as GRPO/DAPO-style trainers do).

The policy-gradient term is PPO's clipped surrogate per token,
`−min(r·A, clip(r, 1−ε_low, 1+ε_high)·A)` with `r = exp(logp − logp_behaviour)`,
so trajectories from a slightly older policy are corrected, and those from a
much older one are bounded (and, past the data staleness bound, dropped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


def sft_loss_sum(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    return -(logprobs * loss_mask.to(logprobs.dtype)).sum()


@dataclass(frozen=True)
class PolicyGradientStats:
    clipped_fraction: float
    mean_ratio: float


def clipped_policy_gradient_sum(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[torch.Tensor, PolicyGradientStats]:
    """Sum over loss tokens of the clipped surrogate loss; all tensors are aligned per target token."""
    mask = loss_mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - behaviour_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        count = mask.sum().clamp(min=1)
        stats = PolicyGradientStats(
            clipped_fraction=float(((clipped < unclipped).to(mask.dtype) * mask).sum() / count),
            mean_ratio=float((ratio * mask).sum() / count),
        )
    return (per_token * mask).sum(), stats


def stale_trajectory_mask(
    policy_versions: torch.Tensor, current_version: int, max_data_staleness: int,
    policy: Literal["drop", "error"] = "drop", valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """Which entries come from a policy at most `max_data_staleness` versions old.

    `policy_versions` is per row or per token (packed rows mix documents);
    `valid` marks the entries that count (e.g. loss tokens). Returns (keep mask,
    number of stale valid entries). With `error`, a stale entry raises instead.
    """
    stale = (current_version - policy_versions) > max_data_staleness
    if valid is not None:
        stale &= valid
    num_stale = int(stale.sum())
    if num_stale and policy == "error":
        where = stale.nonzero()[:8].tolist()
        raise ValueError(
            f"{num_stale} trajectory entries (first at {where}) come from a policy more than max_data_staleness="
            f"{max_data_staleness} versions older than the current version {current_version}; set "
            "rl.stale_trajectories='drop' or raise the bound"
        )
    return ~stale, num_stale
