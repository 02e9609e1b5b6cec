"""`FullyShard`: the model sharded over the processes with FSDP2 (`train.sharding = "fsdp"`).

`shard.py` makes the units and holds what the trainer needs of FSDP's
internals (`ShardSnapshot`, `backward_to_shards`, `recover_after_failed_pass`);
this class is the `Parallelism` the trainer asks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..base import WeightSnapshot
from .shard import ShardedModel, ShardSnapshot, fsdp_param_of, recover_after_failed_pass, shard_model


class FullyShard:
    """A model `shard_model` sharded: parameters, gradients and AdamW state are this rank's shards."""

    name: ClassVar[str] = "fsdp"
    reduces_in_backward: ClassVar[bool] = True
    adopts_injected_adapters: ClassVar[bool] = True
    shards_weights: ClassVar[bool] = True

    def __init__(self, sharded: ShardedModel) -> None:
        self.sharded = sharded
        """The FSDP units and parameters (`shard_model`'s or `fsdp.load`'s result)."""

    @property
    def model(self) -> nn.Module:
        return self.sharded.model

    @classmethod
    def wrap(cls, model: nn.Module, mesh: DeviceMesh, *, param_dtype: torch.dtype | None = None) -> FullyShard:
        """`shard_model(model, mesh, param_dtype=...)`: collective, every rank of `mesh` calls it."""
        return cls(shard_model(model, mesh, param_dtype=param_dtype))

    def manages(self, param: torch.Tensor) -> bool:
        return fsdp_param_of(param) is not None

    def compute_dtype(self, weight: torch.Tensor) -> torch.dtype:
        fsdp_param = fsdp_param_of(weight)
        return (fsdp_param.param_dtype if fsdp_param is not None else None) or weight.dtype

    def weight_storages(self) -> frozenset[int]:
        # Stable for the model's life (fsdp contract test): FSDP's unsharded parameters, whose data_ptr moves.
        return self.sharded.unsharded_storages()

    def snapshot(self, params: Iterable[torch.Tensor]) -> WeightSnapshot | None:
        """FSDP holds the parameter objects (its units gather them), so they stay; and it gathers the shards again
        in backward, so a graph differentiated after the step would get the new weights' Jacobian. Its backward
        gathers a copy of this rank's shards at this revision instead (1/W of the weights)."""
        params = list(params)
        if not any(self.manages(p) for p in params):
            return None  # a head's parameters: replicated, its checkpoint detaches the revision
        return ShardSnapshot.capture(self.sharded.fsdp_params(params))

    def check_reduction(self, reduction: object) -> None:
        if not getattr(reduction, "for_sharded_model", False):
            raise ValueError(
                f"a sharded model's gradients are summed by FSDP's reduce-scatter (ShardedSum) or, for logical ranks "
                "(train.reduction = 'deterministic'), folded by "
                "trainer_core.parallel.fsdp.gradients.ShardedLogicalGradients; not by "
                f"{type(reduction).__name__}, which reduces full gradients — use one of those two"
            )

    def recover_after_failed_pass(self) -> None:
        recover_after_failed_pass(self.sharded)
