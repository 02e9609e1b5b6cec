"""The tensors a parallelism spreads over ranks, as the trainer library reads them (no object needed).

A parameter, a gradient or a norm may be a distributed tensor (a DTensor: a
sharded parallelism's) or a plain one (replicated). These functions read
both the same way, so the trainer library never asks which it holds: every
distributed tensor answers for itself, whichever parallelism made it.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's local part of a distributed tensor (no copy, no collective); a plain tensor as it is."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def is_distributed(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is spread over ranks (each rank holds a part), as opposed to whole on every rank."""
    return isinstance(tensor, DTensor)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full value of a distributed tensor (collective: every rank calls it); a plain tensor as it is.

    A distributed gradient's norm is a partial norm per rank; the whole one is what clips, and a non-finite part
    anywhere makes it non-finite on every rank."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
