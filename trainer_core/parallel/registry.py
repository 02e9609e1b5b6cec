"""`PARALLELISMS`: each parallelism's class by its `train.sharding` name, checked against the torch-free names.

The config offers `PARALLELISM_NAMES` (`names.py`) without importing torch;
registering a class without naming it there (or the other way round) fails
here, at the first import of a parallelism, not silently in the config.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import Parallelism
from .fsdp import FullyShard
from .hsdp import HybridShard
from .names import PARALLELISM_NAMES
from .replicated import Replicated

PARALLELISMS: dict[str, type[Parallelism]] = {cls.name: cls for cls in (Replicated, FullyShard, HybridShard)}
"""Every parallelism by its `train.sharding` name, in `PARALLELISM_NAMES`' order."""

if tuple(PARALLELISMS) != PARALLELISM_NAMES:
    raise ImportError(
        f"parallelism registry {tuple(PARALLELISMS)} differs from trainer_core.parallel.names.PARALLELISM_NAMES "
        f"{PARALLELISM_NAMES}; name every registered parallelism there, in the same order"
    )


def parallelism_for(name: str, model: nn.Module, mesh: Any, *, param_dtype: torch.dtype | None = None) -> Parallelism:
    """`model` spread over the processes of `mesh` by the parallelism `name` (collective where it shards)."""
    if name not in PARALLELISMS:
        raise ValueError(f"train.sharding = {name!r}; choose one of {PARALLELISM_NAMES}")
    return PARALLELISMS[name].wrap(model, mesh, param_dtype=param_dtype)
