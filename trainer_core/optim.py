"""AdamW with warm-up and gradient clipping; a non-finite norm skips the update."""

from __future__ import annotations

import math

import torch

from .config import TrainSection


def build_optimizer(model: torch.nn.Module, train: TrainSection) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params, lr=train.learning_rate, betas=train.betas, eps=train.eps, weight_decay=train.weight_decay
    )


def learning_rate_at(step: int, train: TrainSection) -> float:
    """Linear warm-up over `warmup_steps`, then constant. Stateless, so resume needs nothing."""
    if train.warmup_steps and step < train.warmup_steps:
        return train.learning_rate * (step + 1) / train.warmup_steps
    return train.learning_rate


def clip_and_step(optimizer: torch.optim.AdamW, step: int, train: TrainSection) -> tuple[float, bool]:
    """Clip, step and zero the gradients; returns (grad norm, whether the update ran).

    Every rank holds the same reduced gradient, so every rank takes the same
    decision to skip a non-finite update.
    """
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    max_norm = train.grad_clip if train.grad_clip > 0 else math.inf
    norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    stepped = math.isfinite(norm)
    if stepped:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(step, train)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, stepped
