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
# torch 2.13 renamed all_gather_into_tensor (deprecated there); the package supports torch >= 2.6.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def ordered_fold(partials: torch.Tensor) -> torch.Tensor:
    """`partials[0] + partials[1] + … + partials[-1]`, left to right, over the first dimension."""
    if partials.shape[0] == 1:
        return partials[0].clone()
    # The first two in one pass (a clone, then an add, reads and writes the whole vector once more): the same bits.
    folded = torch.add(partials[0], partials[1])
    for partial in partials[2:]:
        folded.add_(partial)
    return folded


def shard_layout(numel: int, world_size: int) -> int:
    """The slice each process owns: `chunk` elements (the last one padded), `world_size * chunk` in all."""
    return -(-numel // world_size)


def to_shard_layout(partials: torch.Tensor, world_size: int) -> torch.Tensor:
    """[L/W, N] partials in logical order → the [W, L/W, chunk] layout `sharded_ordered_fold` takes."""
    num_local, numel = partials.shape
    chunk = shard_layout(numel, world_size)
    padded = torch.zeros(num_local, world_size * chunk, dtype=partials.dtype, device=partials.device)
    padded[:, :numel] = partials
    return padded.view(num_local, world_size, chunk).transpose(0, 1).contiguous()


def sharded_ordered_fold(local_partials: torch.Tensor, topology: Topology) -> torch.Tensor:
    """The ordered fold over all L logical ranks of flat partials, on every process.

    `local_partials` is [W, L/W, chunk] (`chunk = shard_layout(N, W)`): this
    process's logical ranks' partials, in logical order in dimension 1, each
    cut into the W slices the processes own (zero-padded to W·chunk) — the
    layout the all-to-all sends without another copy. Returns the [W·chunk]
    fold (the caller drops the padding), bitwise the same at every W.
    """
    world_size, num_local, chunk = local_partials.shape
    if world_size == 1:
        return ordered_fold(local_partials[0])
    # Rank w receives, from each rank p in turn, p's partials of the slice w owns.
    received = torch.empty_like(local_partials)
    dist.all_to_all_single(received, local_partials)
    folded_slice = ordered_fold(in_logical_order(received, topology))
    gathered = torch.empty(world_size * chunk, dtype=local_partials.dtype, device=local_partials.device)
    all_gather_single(gathered, folded_slice)
    return gathered


def in_logical_order(received: torch.Tensor, topology: Topology) -> torch.Tensor:
    """The [W, L/W, chunk] partials an all-to-all brought this process, as [L, chunk] rows in logical-rank order."""
    world_size, num_local, chunk = received.shape
    if topology.assignment == "round_robin":
        # Rank p's block holds logical ranks p, p + W, …: row (p, j) is ℓ = j·W + p, so read it j-major.
        return received.transpose(0, 1).reshape(world_size * num_local, chunk)
    # Rank p's block holds logical ranks p·L/W …, so the rows are in logical order.
    return received.view(world_size * num_local, chunk)


def reduce_over_logical_ranks(
    values: Mapping[int, torch.Tensor | None] | Sequence[torch.Tensor | None], op: ReduceOp, topology: Topology
) -> torch.Tensor:
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
    if isinstance(values, Mapping):
        by_rank = dict(values)
    else:
        if len(values) != len(local):
            raise ValueError(
                f"got {len(values)} values for this process's {len(local)} logical ranks {list(local)}; "
                "pass one per logical rank (None for one without data) or a {logical_rank: tensor} mapping"
            )
        by_rank = {rank: value for rank, value in zip(local, values)}
    foreign = sorted(set(by_rank) - set(local))
    if foreign:
        raise ValueError(f"logical rank(s) {foreign} are not run by this process (it runs {list(local)})")
    mine = [(rank, value.detach().cpu()) for rank in local if (value := by_rank.get(rank)) is not None]
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
