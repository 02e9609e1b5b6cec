"""Run under torchrun by test_fsdp_contract: the FSDP2 behaviour trainer_core.training.sharding relies on.

Each check prints one RESULT line per rank (tests/trainer/sharded_ranks.py).
These are torch 2.13 internals or lightly documented behaviour (plan risk R3);
a torch upgrade that changes one must fail here, by name, rather than
silently change a gradient elsewhere.
"""

from __future__ import annotations

import copy
import math
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState
from torch.distributed.tensor import DTensor

from tests.trainer.models import tiny_qwen3
from tests.trainer.sharded_ranks import bf16_reference, bitwise, emit, loss, rank_batch, start
from trainer_core.parallel.fsdp.shard import fsdp_params, shard_model
from trainer_core.run.distributed import run_rank_process

METHODS = (
    "set_force_sum_reduction_for_comms",
    "set_gradient_divide_factor",
    "set_custom_reduce_scatter",
    "reset_iter_state",
    "unshard",
    "reshard",
)


class RecordingReduceScatter(ReduceScatter):
    """FSDP's reduce-scatter, recording the op FSDP asks for."""

    def __init__(self) -> None:
        self.ops: list[str] = []

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.ops.append(str(op))
        return dist.reduce_scatter_single(
            output_tensor,
            input_tensor,
            op=op,  # pyright: ignore[reportArgumentType]  # FSDP passes a ReduceOp, which the stub does not list
            group=group,
            async_op=async_op,
        )


def local(fp) -> torch.Tensor:
    return cast(DTensor, fp.sharded_param).to_local()


def check_api(rank, world_size, mesh):
    model = copy.deepcopy(tiny_qwen3(vocab=97))
    sharded = shard_model(model, mesh)
    params = sharded.fsdp_params()
    rows = {fp: fp.sharded_param.shape[0] for fp in params}
    emit(
        "api",
        rank,
        methods=all(callable(getattr(FSDPModule, name, None)) for name in METHODS),
        state_has_param_groups=all(hasattr(fully_shard.state(unit), "_fsdp_param_groups") for unit in sharded.units),
        num_fsdp_params=len(params),
        num_parameters=len(list(model.parameters())),
        flat_1d=all(fp._sharded_param_data.dim() == 1 for fp in params),
        # The flat shard is the padded local rows: ceil(rows / W) x the other dims.
        padded_numel=all(
            fp._sharded_param_data.numel() == -(-rows[fp] // world_size) * math.prod(fp.sharded_param.shape[1:])
            for fp in params
        ),
        # The DTensor's local tensor is a view of the flat shard (the optimizer writes what the all-gather reads).
        local_view_of_flat=all(
            local(fp).numel() == 0 or local(fp).data_ptr() == fp._sharded_param_data.data_ptr() for fp in params
        ),
        param_dtype_none=all(fp.param_dtype is None for fp in params),
        resharded=all(fp.sharded_state is ShardedState.SHARDED for fp in params),
    )


def check_reduce_op(rank, world_size, mesh):
    ops = {}
    for setting in ("default", "sum"):
        model = copy.deepcopy(tiny_qwen3(vocab=97))
        units = [*model.model.layers, model]
        for unit in units:
            fully_shard(unit, mesh=mesh)
        recorder = RecordingReduceScatter()
        for unit in units:
            if setting == "sum":
                unit.set_force_sum_reduction_for_comms(True)
                unit.set_gradient_divide_factor(1.0)
            unit.set_custom_reduce_scatter(recorder)
        loss(model, 1, rank, world_size).backward()
        ops[setting] = sorted(set(recorder.ops))
        ops[f"{setting}_calls"] = len(recorder.ops)
    emit("reduce_op", rank, **ops)


def check_reshard_frees_and_identity(rank, world_size, mesh):
    model = copy.deepcopy(tiny_qwen3(vocab=97))
    sharded = shard_model(model, mesh)
    params = sharded.fsdp_params()
    objects = [id(fp.unsharded_param) for fp in params]
    storages = sharded.unsharded_storages()
    versions = [fp.unsharded_param._version for fp in params]
    graph = loss(model, 1, rank, world_size)
    after_forward = sum(fp.unsharded_param.untyped_storage().nbytes() for fp in params)
    graph.backward()
    after_backward = sum(fp.unsharded_param.untyped_storage().nbytes() for fp in params)
    loss(model, 2, rank, world_size).backward()
    emit(
        "reshard_frees",
        rank,
        unsharded_bytes_after_forward=after_forward,
        unsharded_bytes_after_backward=after_backward,
        same_objects=objects == [id(fp.unsharded_param) for fp in params],
        same_storages=storages == sharded.unsharded_storages(),
        versions_unchanged=versions == [fp.unsharded_param._version for fp in params],
    )


def check_autograd_grad(rank, world_size, mesh):
    model = copy.deepcopy(tiny_qwen3(vocab=97))
    shard_model(model, mesh)
    grads = torch.autograd.grad(loss(model, 1, rank, world_size), list(model.parameters()), allow_unused=True)
    emit("autograd_grad", rank, not_none=sum(g is not None for g in grads), num=len(grads))


def check_grad_accumulates(rank, world_size, mesh):
    model = copy.deepcopy(tiny_qwen3(vocab=97))
    shard_model(model, mesh)

    def local_grads():
        return [cast(DTensor, p.grad).to_local().clone() for p in model.parameters()]

    loss(model, 1, rank, world_size).backward()
    first = local_grads()
    model.zero_grad(set_to_none=True)
    loss(model, 2, rank, world_size).backward()
    second = local_grads()
    model.zero_grad(set_to_none=True)
    loss(model, 1, rank, world_size).backward()
    assigned = local_grads()
    loss(model, 2, rank, world_size).backward()
    both = local_grads()
    emit(
        "grad_accumulates",
        rank,
        none_then_assigned=all(bitwise(a, b) for a, b in zip(assigned, first)),
        existing_then_added=all(bitwise(c, a + b) for c, a, b in zip(both, first, second)),
    )


def halved_forward(rank, mesh, param_dtype):
    """A forward with every `_sharded_param_data` pointed at a halved clone, vs the unsharded model with halved weights."""
    master = tiny_qwen3(vocab=97)
    model = copy.deepcopy(master)
    shard_model(model, mesh, param_dtype=param_dtype)
    live = {}
    for fp in fsdp_params(model):
        live[fp] = fp._sharded_param_data
        fp._sharded_param_data = (live[fp] * 0.5).to(param_dtype or live[fp].dtype)
    ids, mask = rank_batch(0, rank)
    with torch.no_grad():
        swapped = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        for fp, data in live.items():
            fp._sharded_param_data = data
        restored = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        halved = copy.deepcopy(master)
        for p in halved.parameters():
            p.mul_(0.5)
        reference = halved if param_dtype is None else bf16_reference(halved)
        plain = master if param_dtype is None else bf16_reference(master)
        expected = reference(input_ids=ids, attention_mask=mask, use_cache=False).logits
        expected_restored = plain(input_ids=ids, attention_mask=mask, use_cache=False).logits
    return {"swapped_bitwise": bitwise(swapped, expected), "restored_bitwise": bitwise(restored, expected_restored)}


def check_all_gather_reads_the_flat_shard(rank, world_size, mesh):
    emit("all_gather_reads_flat_shard_fp32", rank, **halved_forward(rank, mesh, None))
    emit("all_gather_reads_flat_shard_bf16", rank, **halved_forward(rank, mesh, torch.bfloat16))


def main() -> None:
    rank, world_size, mesh = start()
    check_api(rank, world_size, mesh)
    check_reduce_op(rank, world_size, mesh)
    check_reshard_frees_and_identity(rank, world_size, mesh)
    check_autograd_grad(rank, world_size, mesh)
    check_grad_accumulates(rank, world_size, mesh)
    check_all_gather_reads_the_flat_shard(rank, world_size, mesh)


if __name__ == "__main__":
    run_rank_process(main)
