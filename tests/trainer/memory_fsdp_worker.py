"""Run under torchrun by test_memory_prediction: the bytes a sharded model and its AdamW hold, next to the prediction.

Per compute dtype (FP32, and bf16 under FSDP's MixedPrecisionPolicy), each rank
shards a tiny Qwen3 with `shard_model`, runs one backward and one
`torch.optim.AdamW` step over the DTensor parameters, then counts what this
process holds: every live tensor's storage (a `gc` walk, each storage once;
DTensors through their local tensors), and the structural count (the local
tensors of the parameters, their gradients and the optimizer state). It prints
both with the memory model's prediction for the same model, built on the meta
device (one RESULT line per check and rank, tests/trainer/sharded_ranks.py).
"""

from __future__ import annotations

import gc

import torch
from torch.distributed.tensor import DTensor

from tests.trainer.models import tiny_qwen3
from tests.trainer.sharded_ranks import emit, loss, start
from trainer_core.memory_model import MemorySettings, predict
from trainer_core.memory_shape import activation_fit, meta_model, model_shape
from trainer_core.parallel.fsdp.shard import shard_model
from trainer_core.run.distributed import run_rank_process


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _storage_bytes(tensors) -> int:
    storages = {}
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


def _every_live_tensor() -> list[torch.Tensor]:
    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and not isinstance(o, DTensor)]


def check_state_bytes(rank: int, world_size: int, mesh, dtype: str) -> None:
    model = tiny_qwen3(vocab=97)
    config = model.config
    baseline = _storage_bytes(_every_live_tensor()) - _storage_bytes(model.parameters())  # buffers, the mesh, ...
    shard_model(model, mesh, param_dtype=torch.bfloat16 if dtype == "bfloat16" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss(model, 0, rank, world_size).backward()
    optimizer.step()
    params = list(model.parameters())
    structural = _storage_bytes(
        [*params, *(p.grad for p in params if p.grad is not None)]
        + [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    )
    held = _storage_bytes(_every_live_tensor()) - baseline
    settings = MemorySettings(sharding="fsdp", world_size=world_size, dtype=dtype)
    shape = model_shape(meta_model(config, "float32"))
    estimate = predict(shape, activation_fit(config, dtype), settings)
    emit(f"state_{dtype}", rank, predicted=estimate.state, held=held, structural=structural)


def main() -> None:
    rank, world_size, mesh = start()
    for dtype in ("float32", "bfloat16"):
        check_state_bytes(rank, world_size, mesh, dtype)


if __name__ == "__main__":
    run_rank_process(main)
