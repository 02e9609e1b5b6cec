"""The token-level clipped policy gradient on RL trajectories (`train.objective = "clipped_policy_gradient"`).

The policy-gradient term is PPO's clipped surrogate per token,
`−min(r·A, clip(r, 1−ε_low, 1+ε_high)·A)` with `r = exp(logp − logp_behaviour)`,
so trajectories from a slightly older policy are corrected, and those from a
much older one are bounded (and, past the data staleness bound, dropped).
Like SFT's, the loss is a sum over loss tokens (token-level normalisation, as
GRPO/DAPO-style trainers do).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from .base import LiveColumn, LossSum
from .sft import select, sft_loss_sum, weighed


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
    logprobs, behaviour_logprobs, advantages = (select(x, keep) for x in (logprobs, behaviour_logprobs, advantages))
    ratio = torch.exp(logprobs - behaviour_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        count = loss_mask.to(logprobs.dtype).sum().clamp(min=1)
        stats = PolicyGradientStats(
            # Sums over the full layout (zeros where masked), as before the selection: the same bits.
            clipped_fraction=float(weighed((clipped < unclipped).to(count.dtype), loss_mask).sum() / count),
            mean_ratio=float(weighed(ratio, loss_mask).sum() / count),
        )
    return weighed(per_token, loss_mask).sum(), stats


def stale_trajectory_mask(
    policy_versions: torch.Tensor,
    current_version: int,
    max_data_staleness: int,
    policy: Literal["drop", "error"] = "drop",
    valid: torch.Tensor | None = None,
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


def count_documents(selected: torch.Tensor, rows: Mapping[str, torch.Tensor]) -> int:
    """Documents with any selected target token (a packed row holds several)."""
    if "document_ids" not in rows:
        return int(selected.any(dim=1).sum())
    documents = rows["document_ids"][:, 1:].long()
    row_index = torch.arange(documents.shape[0])[:, None].expand_as(documents)
    keys = (row_index * (int(documents.max()) + 1) + documents)[selected]
    return int(keys.unique().numel())


class ClippedPolicyGradient:
    """The clipped surrogate on trajectories, with an optional SFT term and the data staleness bound (`[rl]`)."""

    name: ClassVar[str] = "clipped_policy_gradient"
    figures: ClassVar[tuple[str, ...]] = ("clipped_tokens", "ratio_sum", "kept_tokens")
    needs: ClassVar[tuple[str, ...]] = ("loss_mask", "behaviour_logprobs", "advantages", "policy_version")
    live_columns: ClassVar[tuple[LiveColumn, ...]] = (
        LiveColumn("stale_trajectories_dropped", "stale_dropped", 0),
        LiveColumn("clip_fraction", "clip_fraction", 4),
        LiveColumn("mean_importance_ratio", "importance_ratio", 4),
    )

    def __init__(
        self,
        *,
        clip_low: float,
        clip_high: float,
        sft_coef: float,
        initial_policy_version: int,
        max_data_staleness: int | None,
        stale_trajectories: Literal["drop", "error"],
    ) -> None:
        self.clip_low, self.clip_high, self.sft_coef = clip_low, clip_high, sft_coef
        self.initial_policy_version = initial_policy_version
        self.max_data_staleness = max_data_staleness
        self.stale_trajectories: Literal["drop", "error"] = stale_trajectories

    @classmethod
    def from_config(cls, config) -> "ClippedPolicyGradient":
        rl = config.rl
        return cls(
            clip_low=rl.clip_low,
            clip_high=rl.clip_high,
            sft_coef=rl.sft_coef,
            initial_policy_version=rl.initial_policy_version,
            max_data_staleness=rl.max_data_staleness,
            stale_trajectories=rl.stale_trajectories,
        )

    def loss_sum(self, logprobs: torch.Tensor, rows: Mapping[str, torch.Tensor], *, revision: int) -> LossSum:
        version = self.initial_policy_version + revision  # each optimizer step is one policy version
        loss_mask = rows["loss_mask"][:, 1:]
        num_stale = 0
        mask = loss_mask
        if self.max_data_staleness is not None:
            keep, num_stale_tokens = stale_trajectory_mask(
                rows["policy_version"][:, 1:],
                version,
                self.max_data_staleness,
                self.stale_trajectories,
                valid=loss_mask,
            )
            if num_stale_tokens:
                num_stale = count_documents(loss_mask & ~keep, rows)
                mask = loss_mask & keep
        loss, stats = clipped_policy_gradient_sum(
            logprobs,
            rows["behaviour_logprobs"][:, 1:],
            rows["advantages"][:, 1:],
            mask,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
        )
        num_tokens = float(mask.sum())
        # float32, as these sums have always been: the step figures keep their bits.
        sums = torch.tensor(
            [stats.clipped_fraction * num_tokens, stats.mean_ratio * num_tokens, num_tokens], dtype=torch.float32
        )
        if self.sft_coef:
            loss = loss + self.sft_coef * sft_loss_sum(logprobs, mask)
        return LossSum(loss, dict(zip(self.figures, sums.tolist())), num_stale)

    def for_evaluation(self) -> "ClippedPolicyGradient":
        """Without the staleness bound: held-out trajectories are measured whatever policy sampled them (the bound
        decides what trains; the held-out loss divides by every held-out loss token)."""
        return ClippedPolicyGradient(
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            sft_coef=self.sft_coef,
            initial_policy_version=self.initial_policy_version,
            max_data_staleness=None,
            stale_trajectories=self.stale_trajectories,
        )

    def step_figures(self, sums: Mapping[str, float]) -> dict[str, float | int | None]:
        # Fractions over the loss tokens kept; None when the step kept none (all stale).
        kept = sums["kept_tokens"]
        return {
            "stale_trajectories_dropped": int(sums["stale_trajectories"]),
            "clip_fraction": sums["clipped_tokens"] / kept if kept else None,
            "mean_importance_ratio": sums["ratio_sum"] / kept if kept else None,
        }
