"""A gradient's part of a norm: which of its dim-0 rows this process holds, and over which group the rows spread.

`ranks.canonical_norm` sums squares per dim-0 row and completes the row
vector with one all-reduce. It never asks which parallelism made a gradient:
it asks this module for the rows this process holds, where they start in the
whole tensor, and the process group the rows are spread over (None for a
gradient whole on every process, a replicated one).

A sharded parallelism's gradient is sharded on dim 0 over one mesh dimension
(FSDP2's layout; HSDP's within each replica) and replicated over any other
(HSDP's replicas): every replica holds the same rows, so completing the
vector within the shard group gives every replica the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["NormPart", "norm_part"]


@dataclass(frozen=True)
class NormPart:
    """What one process holds of a gradient, for a norm over dim-0 rows."""

    start: int
    """Index, in the whole tensor, of the first dim-0 row `local` holds."""
    local: torch.Tensor
    """This process's rows (no copy): the whole tensor for a replicated gradient."""
    group: dist.ProcessGroup | None
    """The processes the rows are spread over (each holds its own); None when every process holds them all."""


def norm_part(gradient: torch.Tensor) -> NormPart:
    """This process's part of `gradient` (no collective); ValueError for a layout other than dim-0 sharding."""
    if not isinstance(gradient, DTensor):
        return NormPart(start=0, local=gradient, group=None)
    shard_dim = _shard_dim(gradient)
    whole_rows = int(gradient.shape[0])
    world_size = gradient.device_mesh.size(shard_dim)
    coordinate = gradient.device_mesh.get_local_rank(shard_dim)
    # torch.chunk's layout, which FSDP2 uses: ceil(rows / W) rows per process, the last ones short or empty.
    start = min(coordinate * -(-whole_rows // world_size), whole_rows)
    return NormPart(start=start, local=gradient._local_tensor, group=gradient.device_mesh.get_group(shard_dim))


def _shard_dim(gradient: DTensor) -> int:
    """The mesh dimension `gradient` is sharded over (on its dim 0); every other mesh dimension replicates it."""
    placements = gradient.placements
    sharded = [i for i, placement in enumerate(placements) if placement.is_shard(0)]
    if len(sharded) != 1 or any(not p.is_replicate() for i, p in enumerate(placements) if i != sharded[0]):
        raise ValueError(
            "canonical_norm takes gradients sharded on dim 0 over one mesh dimension and replicated over any other "
            f"(FSDP2's and HSDP's layouts), got {placements}"
        )
    return sharded[0]
