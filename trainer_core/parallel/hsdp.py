"""`HybridShard`: shard within a node, replicate across nodes (HSDP, `train.sharding = "hsdp"`).

FSDP2's `fully_shard` over a 2-D device mesh, ("replicate", "shard") =
(nodes, processes per node): each node holds one full copy of the weights,
gradients and AdamW state, sharded over its processes, so the all-gathers of
forward and backward stay inside a node; the gradients are reduce-scattered
within the node, then all-reduced across nodes. Everything else is
`FullyShard`'s: the units, the snapshots of stale graphs, the state and the
export (a DTensor over the 2-D mesh answers for itself).

The deterministic reduction is FullyShard's ordered fold, which sees the 2-D
mesh (`fsdp/fold.py`): every process's chunk is added in process order at
replica 0's owners, so losses, weights and AdamW state are bitwise the
unsharded run's at any nodes × processes. It needs at least 2 processes per
node (FSDP reduces nothing within a replica of one).

The mesh's shape is read from the launch, not the config: the processes on
this node (torchrun's `LOCAL_WORLD_SIZE`, `train.nproc_per_node` in a
pipeline launch) shard, and the nodes (`WORLD_SIZE / LOCAL_WORLD_SIZE`,
`train.nnodes`) replicate; a run resumed at another shape reshards its
state on load like FSDP's.
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .fsdp import FullyShard
from .fsdp.shard import ShardedModel, shard_model

MESH_DIMS = ("replicate", "shard")


def hybrid_mesh(world: DeviceMesh) -> DeviceMesh:
    """The 2-D (nodes, processes per node) mesh over the processes of the 1-D `world` mesh (collective)."""
    if world.ndim == 2:
        return world
    world_size = world.size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if per_node < 1 or world_size % per_node:
        raise ValueError(
            f"HSDP shards over the {per_node} processes of a node and replicates over the nodes, but the "
            f"{world_size} processes are not whole nodes; launch the same train.nproc_per_node on every node"
        )
    return init_device_mesh(world.device_type, (world_size // per_node, per_node), mesh_dim_names=MESH_DIMS)


class HybridShard(FullyShard):
    """A model sharded over the processes of a node and replicated over the nodes (module docstring)."""

    name: ClassVar[str] = "hsdp"

    def __init__(self, sharded: ShardedModel) -> None:
        params = sharded.fsdp_params()
        mesh = params[0].mesh_info.mesh if params else None
        if mesh is not None and mesh.ndim != 2:
            # A model loaded by rows (`model.path`) was sharded over the mesh its loader was given.
            raise ValueError(
                f"HSDP shards over a 2-D (nodes, processes per node) mesh, but this model is sharded over a "
                f"{mesh.ndim}-D one (model.path loads under train.sharding = 'fsdp' only, for now); "
                "set train.sharding = 'fsdp', or build the model from model.config"
            )
        super().__init__(sharded)

    @classmethod
    def wrap(cls, model: nn.Module, mesh: DeviceMesh, *, param_dtype: torch.dtype | None = None) -> HybridShard:
        """`shard_model` over `hybrid_mesh(mesh)`: collective, every rank of `mesh` calls it."""
        return cls(shard_model(model, hybrid_mesh(mesh), param_dtype=param_dtype))
