"""Logical ranks' gradients laid out flat for the sharded ordered fold, and the fold's result handed back.

`sharded_ordered_fold` takes a [W, L/W, chunk] tensor: row j of slice w holds
the w-th `chunk` elements of this process's j-th logical rank's flat partial
(zero-padded to W·chunk). Both the fold at the step and the buckets folded
while the last backward runs (`fold_buckets.py`) write it here, member by
member, so they lay out the same elements the same way: the fold is
element-wise, so the bits of a sum do not depend on which message carried it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .reduction import shard_layout

Key = tuple[str, str]  # (checkpoint, parameter)


def pack_partials(
    members: Sequence[tuple[Key, int]],
    rows: Sequence[Mapping[Key, torch.Tensor | None]],
    world_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The [W, len(rows), chunk] send buffer of `members` ((key, numel) in flat order) over the logical ranks' `rows`
    (each {key: gradient}, a missing key counting as zeros). Every element is written once, not zeroed first."""
    numel = sum(count for _, count in members)
    chunk = shard_layout(numel, world_size)
    local = torch.empty(world_size, len(rows), chunk, dtype=dtype, device=device)
    for row, values in enumerate(rows):
        flat = local[:, row, :]  # a strided view: flat element i is at [i // chunk, row, i % chunk]
        offset = 0
        for key, count in members:
            grad = values.get(key)
            write_flat(flat, offset, count, chunk, None if grad is None else grad.reshape(-1))
            offset += count
        write_flat(flat, offset, world_size * chunk - offset, chunk, None)  # the last slice's padding
    return local


def write_flat(sliced: torch.Tensor, offset: int, count: int, chunk: int, values: torch.Tensor | None) -> None:
    """Write `values` (or zeros: None) at flat positions offset … offset + count of a [W, chunk] view (row-major
    over slices)."""
    position, end = offset, offset + count
    while position < end:
        row, column = divmod(position, chunk)
        take = min(chunk - column, end - position)
        target = sliced[row, column : column + take]
        if values is None:
            target.zero_()
        else:
            target.copy_(values[position - offset : position - offset + take])
        position += take


def assign_folded(members: Sequence[tuple[torch.Tensor, bool]], folded: torch.Tensor) -> None:
    """Set each optimized tensor's `.grad` to its view of the flat `folded` sum (`members` in flat order, each with
    whether it takes one: a tensor with no gradient on any rank keeps none)."""
    offset = 0
    for tensor, takes in members:
        if takes:
            tensor.grad = folded[offset : offset + tensor.numel()].view_as(tensor)
        offset += tensor.numel()
