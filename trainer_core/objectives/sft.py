"""Supervised fine-tuning: minus the logprob of every loss token, and the masking both objectives use.

The loss is a *sum* over loss tokens; the caller divides by the number of loss
tokens in the whole global batch, so the loss does not depend on how the
batch is split over ranks (token-level normalisation).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from .base import LiveColumn, LossSum


def select(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))


def weighed(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """`values · loss_mask` where the mask is non-zero, exactly 0 elsewhere — selected, not multiplied, there.

    Masked-out positions routinely hold −inf (a padded or masked vocabulary)
    or NaN (padding of a behaviour-logprob column), and 0·(−inf), 0·NaN are
    NaN. `torch.where` also gives those positions an exact zero gradient. A
    boolean mask selects; a float mask (per-token weights) also weighs.
    """
    if loss_mask.dtype == torch.bool:
        return select(values, loss_mask)
    return select(values * loss_mask.to(values.dtype), loss_mask != 0)


def sft_loss_sum(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    return -weighed(logprobs, loss_mask).sum()


class SFT:
    """`train.objective = "sft"`: the loss on the assistant tokens of conversations."""

    name: ClassVar[str] = "sft"
    figures: ClassVar[tuple[str, ...]] = ()
    needs: ClassVar[tuple[str, ...]] = ("loss_mask",)
    live_columns: ClassVar[tuple[LiveColumn, ...]] = ()

    @classmethod
    def from_config(cls, config) -> "SFT":
        return cls()

    def loss_sum(self, logprobs: torch.Tensor, rows: Mapping[str, torch.Tensor], *, revision: int) -> LossSum:
        return LossSum(sft_loss_sum(logprobs, rows["loss_mask"][:, 1:]))

    def step_figures(self, sums: Mapping[str, float]) -> dict[str, float | int | None]:
        return {}

    def for_evaluation(self) -> "SFT":
        return self
