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


def _select(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))


def _weighed(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """`values · loss_mask` where the mask is non-zero, exactly 0 elsewhere — selected, not multiplied, there.

    Masked-out positions routinely hold −inf (a padded or masked vocabulary)
    or NaN (padding of a behaviour-logprob column), and 0·(−inf), 0·NaN are
    NaN. `torch.where` also gives those positions an exact zero gradient. A
    boolean mask selects; a float mask (per-token weights) also weighs.
    """
    if loss_mask.dtype == torch.bool:
        return _select(values, loss_mask)
    return _select(values * loss_mask.to(values.dtype), loss_mask != 0)


def sft_loss_sum(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    return -_weighed(logprobs, loss_mask).sum()


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
    """Sum over loss tokens of the clipped surrogate loss; all tensors are aligned per target token.

    Positions outside `loss_mask` may hold anything (−inf, NaN): every input is
    selected with the mask before it is used, so they change neither the loss,
    nor the statistics, nor the gradient (exactly zero there).
    """
    keep = torch.broadcast_to(loss_mask != 0, torch.broadcast_shapes(logprobs.shape, loss_mask.shape))
    # Selecting the inputs, not only the per-token loss: exp(NaN − x) would give NaN in the backward of `where`'s
    # unused branch (0 · NaN). At masked positions the ratio is then exp(0) = 1 and the advantage 0, both finite.
    # Each keeps its own dtype, so the arithmetic promotes as it did before the selection.
    logprobs, behaviour_logprobs, advantages = (_select(x, keep) for x in (logprobs, behaviour_logprobs, advantages))
    ratio = torch.exp(logprobs - behaviour_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        count = loss_mask.to(logprobs.dtype).sum().clamp(min=1)
        stats = PolicyGradientStats(
            # Sums over the full layout (zeros where masked), as before the selection: the same bits.
            clipped_fraction=float(_weighed((clipped < unclipped).to(count.dtype), loss_mask).sum() / count),
            mean_ratio=float(_weighed(ratio, loss_mask).sum() / count),
        )
    return _weighed(per_token, loss_mask).sum(), stats


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
