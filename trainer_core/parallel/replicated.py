"""`Replicated`: every rank holds the whole model (plain data parallelism, `train.sharding = "none"`).

Autograd runs as it would on one process, each rank's gradients are summed
at the step (`training.gradient_reduction.RankSum`), and a stale graph keeps
its weights by the checkpoint detaching its revision.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from .base import WeightSnapshot


class Replicated:
    """The whole model on every rank; nothing to gather, snapshot or recover."""

    name: ClassVar[str] = "none"
    reduces_in_backward: ClassVar[bool] = False
    adopts_injected_adapters: ClassVar[bool] = False
    shards_weights: ClassVar[bool] = False

    def __init__(self, model: nn.Module) -> None:
        self._model = model

    @property
    def model(self) -> nn.Module:
        return self._model

    @classmethod
    def wrap(cls, model: nn.Module, mesh: Any, *, param_dtype: torch.dtype | None = None) -> Replicated:
        """Nothing to spread: every rank already holds the model it built."""
        return cls(model)

    def manages(self, param: torch.Tensor) -> bool:
        return False

    def compute_dtype(self, weight: torch.Tensor) -> torch.dtype:
        return weight.dtype

    def weight_storages(self) -> frozenset[int]:
        return frozenset()

    def snapshot(self, params: Iterable[torch.Tensor]) -> WeightSnapshot | None:
        return None

    def check_reduction(self, reduction: object) -> None:
        return None

    def recover_after_failed_pass(self) -> None:
        return None
