"""A global gradient norm whose bits depend neither on W nor on whether the gradients are sharded.

`torch.nn.utils.get_total_norm` over FSDP's distributed shards sums each
process's partial sum of squares with an all-reduce: the grouping changes
with W and the result moves by an ulp (measured: equal at W = 1, 2, off by
1.19e-7 at W = 4). The canonical norm fixes every addition's order instead:

1. per dim-0 row of every gradient, the sum of squares in float64. FSDP
   shards on dim 0, so a row never straddles two processes and each row is
   computed whole, by one process, on the same elements at any W (torch's
   row reduction depends on the row's length and the machine's kernels,
   never on how many rows a process holds);
2. the rows of all gradients, in parameter order then row order, form one
   float64 vector; each process fills the rows it holds and leaves the rest
   0, and one all-reduce (SUM) completes it on every process. Exact: every
   element is a sum of one value and zeros;
3. a pairwise fold with a fixed tree (the vector zero-padded to a power of
   two, then halved by adding neighbours: element-wise additions only, so
   the grouping is the tree's whatever W or the vector's placement);
4. the square root in float64, cast to float32.

A replicated (unsharded) gradient fills all its rows on every process and is
not all-reduced, so the sharded and the unsharded trainer agree to the bit.
Over HSDP's 2-D mesh (replicated over the replicas, sharded on dim 0 within
each) the same vector is completed within each replica's shard group: every
replica holds the same shards, so every replica gets the same bits. Which
rows a process holds, and over which group, is the parallelism's answer
(`parallel/norm_parts.py`): this module never asks which one made a gradient.
A non-finite element anywhere makes the norm non-finite on every process
(inf and NaN survive the sums), which is what skips a step everywhere.

For Qwen3-8B the row vector has ~2.0 M entries: a 16 MB all-reduce per step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..parallel.norm_parts import NormPart, norm_part

__all__ = ["canonical_norm", "row_count"]


def row_count(shape: Sequence[int]) -> int:
    """Rows of a gradient of `shape` in the norm's vector (a 0-d tensor is one row)."""
    return int(shape[0]) if len(shape) else 1


def _owned_rows(part: NormPart) -> torch.Tensor:
    """The rows `part` holds, as [rows, -1] float64."""
    local = part.local
    # An explicit row width: a shard with no rows (fewer rows than processes, e.g. LoRA's r = 1 at W = 2) is a
    # [0, width] block, which reshape(0, -1) cannot infer.
    width = math.prod(local.shape[1:]) if local.dim() else 1
    rows = local.detach().reshape(row_count(local.shape), width)
    return rows.to(torch.float64)


def canonical_norm(
    gradients: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The L2 norm of all `gradients` together (module docstring), a `dtype` scalar, the same on every process.

    `dtype=torch.float64` returns the norm before the final cast (its bits are as fixed as the float32's).
    Collective when any gradient is distributed (sharded): every process of `group` (its mesh's group by default)
    calls it with the same list. Plain tensors are taken as replicated: whole on every process.
    """
    missing = [i for i, g in enumerate(gradients) if g is None]
    if missing:
        raise ValueError(
            f"canonical_norm got None at position(s) {missing}: pass only gradients that exist "
            "(a frozen parameter, or one no backward reached, has none)"
        )
    sizes = [row_count(g.shape) for g in gradients]
    device = gradients[0].device if gradients else torch.device("cpu")
    rows = torch.zeros(sum(sizes), dtype=torch.float64, device=device)
    parts = [norm_part(g) for g in gradients]
    sharded_any = False
    offset = 0
    for part, size in zip(parts, sizes, strict=True):
        owned = _owned_rows(part)
        if owned.numel():
            rows[offset + part.start : offset + part.start + owned.shape[0]] = owned.square().sum(dim=1)
        if part.group is not None:
            sharded_any = True
            group = group or part.group
        offset += size
    if sharded_any and dist.get_world_size(group) > 1:
        # Replicated rows would be counted W times: keep them on one process only before the sum.
        if dist.get_rank(group) != 0:
            offset = 0
            for part, size in zip(parts, sizes, strict=True):
                if part.group is None:
                    rows[offset : offset + size] = 0
                offset += size
        dist.all_reduce(rows, group=group)
    return _pairwise_sum(rows).sqrt().to(dtype)


def _pairwise_sum(values: torch.Tensor) -> torch.Tensor:
    """The sum of a 1-D float64 vector by a fixed binary tree: zero-pad to a power of two, add neighbours, repeat."""
    if values.numel() == 0:
        return values.new_zeros(())
    width = 1 << (values.numel() - 1).bit_length()
    level = torch.zeros(width, dtype=values.dtype, device=values.device)
    level[: values.numel()] = values
    while level.numel() > 1:
        level = level[0::2] + level[1::2]
    return level[0]
