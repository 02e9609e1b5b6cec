"""Parallelism: how a model is spread over the processes, one seam below the trainer library.

    from trainer_core.parallel import FullyShard, Replicated, parallelism_for

- `base`: the `Parallelism` protocol, what the trainer asks of one;
- `replicated`: `Replicated`, the whole model on every rank;
- `fsdp`: `FullyShard`, FSDP2 units (`fsdp/shard.py` makes them);
- `hsdp`: `HybridShard`, the same units sharded within a node, replicated
  across nodes (a 2-D mesh);
- `names`: `PARALLELISM_NAMES`, torch-free; `registry`: `PARALLELISMS`, each
  class by its `train.sharding` name;
- `tensors`, `autograd`: a distributed tensor read the same way as a plain
  one (local part, whole value, gradients), for every parallelism.

Nothing outside this package names FSDP or a DTensor placement. The names
load on first use (PEP 562): the config reads `PARALLELISM_NAMES` for
`train.sharding`'s choices, and loading a config must not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy_exports import lazy_exports
from .names import PARALLELISM_NAMES as PARALLELISM_NAMES
from .names import REPLICATED as REPLICATED

_NAMES_BY_MODULE = {
    "autograd": ("gradients",),
    "base": ("Parallelism", "WeightSnapshot"),
    "fsdp": ("FullyShard",),
    "hsdp": ("HybridShard",),
    "registry": ("PARALLELISMS", "parallelism_for"),
    "replicated": ("Replicated",),
    "tensors": ("is_distributed", "local_tensor", "whole"),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _NAMES_BY_MODULE, globals())
__all__ += ["PARALLELISM_NAMES", "REPLICATED"]

if TYPE_CHECKING:  # the lazy names, for type checkers (`X as X`: re-exported on purpose)
    from .autograd import gradients as gradients
    from .base import Parallelism as Parallelism
    from .base import WeightSnapshot as WeightSnapshot
    from .fsdp import FullyShard as FullyShard
    from .hsdp import HybridShard as HybridShard
    from .registry import PARALLELISMS as PARALLELISMS
    from .registry import parallelism_for as parallelism_for
    from .replicated import Replicated as Replicated
    from .tensors import is_distributed as is_distributed
    from .tensors import local_tensor as local_tensor
    from .tensors import whole as whole
