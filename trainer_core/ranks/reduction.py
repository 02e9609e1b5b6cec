"""Reductions over logical ranks whose bits do not depend on the number of processes.

Floating-point addition is not associative: `(g0 + g1) + (g2 + g3)` and
`((g0 + g1) + g2) + g3` differ in the last bits, and an all-reduce adds in
whatever order its algorithm and the world size give. Here every sum over
logical ranks is one fixed fold, `(((v0 + v1) + v2) + … ) + v(L-1)`, element
by element, whichever process computed each term:

- `sharded_ordered_fold` (gradients): each process owns a contiguous slice of
  the flat vector, receives every logical rank's partial for its slice (one
  all-to-all), folds them in logical order and all-gathers the folded slices.
  With L = W it moves what a ring all-reduce moves; with L/W logical ranks per
  process, each sends L/W partials instead of their sum.
- `reduce_over_logical_ranks` (losses, token counts, statistics): every
  process gathers every logical rank's small value and folds them in order.

Element-wise addition uses no intra-op reduction, so the fold itself is the
same at any thread count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
import torch.distributed as dist

from .topology import Topology

ReduceOp = Literal["sum", "mean"]


def ordered_fold(partials: torch.Tensor) -> torch.Tensor:
    """`partials[0] + partials[1] + … + partials[-1]`, left to right, over the first dimension."""
    folded = partials[0].clone()
    for partial in partials[1:]:
        folded.add_(partial)
    return folded


def _slice_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    chunk = -(-numel // world_size)
    return [(min(rank * chunk, numel), min((rank + 1) * chunk, numel)) for rank in range(world_size)]


def sharded_ordered_fold(local_partials: torch.Tensor, topology: Topology) -> torch.Tensor:
    """The ordered fold over all L logical ranks of flat partials, on every process.

    `local_partials` is [L/W, N]: this process's logical ranks' partials in
    logical order. Returns the [N] fold, bitwise the same at every W.
    """
    num_local, numel = local_partials.shape
    if topology.world_size == 1:
        return ordered_fold(local_partials)
    world_size = topology.world_size
    bounds = _slice_bounds(numel, world_size)
    chunk = bounds[0][1] - bounds[0][0]
    # Send to rank w, for each local logical rank in order, the slice rank w owns.
    send = torch.cat([local_partials[:, start:end].reshape(-1) for start, end in bounds])
    own_start, own_end = bounds[topology.rank]
    own = own_end - own_start
    received = torch.empty(world_size * num_local * own, dtype=local_partials.dtype)
    dist.all_to_all_single(received, send, output_split_sizes=[num_local * own] * world_size,
                           input_split_sizes=[num_local * (end - start) for start, end in bounds])
    # Rank p's block holds logical ranks p·L/W …, so the rows are in logical order.
    folded_slice = ordered_fold(received.view(world_size * num_local, own))
    padded = torch.zeros(chunk, dtype=local_partials.dtype)
    padded[:own] = folded_slice
    gathered = torch.empty(world_size * chunk, dtype=local_partials.dtype)
    dist.all_gather_into_tensor(gathered, padded)
    return torch.cat([gathered[rank * chunk:rank * chunk + (end - start)] for rank, (start, end) in enumerate(bounds)])


def reduce_over_logical_ranks(values: Mapping[int, torch.Tensor] | Sequence[torch.Tensor | None], op: ReduceOp,
                              topology: Topology) -> torch.Tensor:
    """Sum (or mean) over logical ranks of one small tensor per logical rank, in logical order, on every process.

    `values` holds this process's logical ranks' tensors: a mapping
    {logical rank: tensor}, or a sequence in the order of
    `topology.local_logical_ranks`. A logical rank without a value (None or
    absent: it had no data) adds nothing; `mean` divides the sum by L, so every
    logical rank counts once. Meant for losses, counts and statistics; gradients
    are reduced by the step.
    """
    if op not in ("sum", "mean"):
        raise ValueError(f"op={op!r}; choose 'sum' or 'mean'")
    local = topology.local_logical_ranks
    if not isinstance(values, Mapping):
        if len(values) != len(local):
            raise ValueError(f"got {len(values)} values for this process's {len(local)} logical ranks {list(local)}; "
                             "pass one per logical rank (None for one without data) or a {logical_rank: tensor} mapping")
        values = {rank: value for rank, value in zip(local, values)}
    foreign = sorted(set(values) - set(local))
    if foreign:
        raise ValueError(f"logical rank(s) {foreign} are not run by this process (it runs {list(local)})")
    mine = [(rank, values[rank].detach().cpu()) for rank in local if values.get(rank) is not None]
    if topology.world_size > 1:
        gathered: list = [None] * topology.world_size
        dist.all_gather_object(gathered, mine)
        mine = [entry for per_rank in gathered for entry in per_rank]
    if not mine:
        raise ValueError("no logical rank contributed a value; at least one must")
    ordered = [value for _, value in sorted(mine, key=lambda entry: entry[0])]
    shapes = {tuple(value.shape) for value in ordered}
    if len(shapes) > 1:
        raise ValueError(f"logical ranks contributed tensors of different shapes {sorted(shapes)}; reduce one shape")
    total = ordered_fold(torch.stack(ordered))
    return total / topology.logical_dp if op == "mean" else total
