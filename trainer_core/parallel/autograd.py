"""Autograd to parameters that may be distributed: the backward each parallelism's engine needs.

A sharded parameter is not the graph's leaf (its engine gathers a whole copy
for the forward), so `torch.autograd.grad` with respect to it would silently
give None; its engine runs the backward into the gathered leaves and reduces
the gradient over ranks inside it. A plain parameter takes plain autograd.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .fsdp.shard import backward_to_shards
from .tensors import is_distributed


def gradients(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    retain_graph: bool,
) -> tuple[torch.Tensor | None, ...]:
    """`torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)`, where inputs may be distributed.

    A distributed input gets this rank's part of the gradient summed over ranks, reduced by its engine inside
    the backward: a collective, as the forward was."""
    if any(is_distributed(t) for t in inputs):
        return backward_to_shards(outputs, grad_outputs, inputs, retain_graph=retain_graph)
    return torch.autograd.grad(
        list(outputs), list(inputs), grad_outputs=list(grad_outputs), retain_graph=retain_graph, allow_unused=True
    )
