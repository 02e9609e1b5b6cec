"""The learning-rate schedule: linear warm-up, then constant. Stateless, so resume needs nothing."""

from __future__ import annotations

from .config import TrainSection


def learning_rate_at(step: int, train: TrainSection) -> float:
    if train.warmup_steps and step < train.warmup_steps:
        return train.learning_rate * (step + 1) / train.warmup_steps
    return train.learning_rate
