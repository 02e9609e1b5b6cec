"""Run under torchrun (2 ranks) by test_device_ranks and bench.gpu_suite: data parallelism on a device.

    python -m torch.distributed.run --nproc-per-node 2 -m tests.trainer.device_rank_worker cpu|cuda

`cpu` uses gloo, `cuda` uses NCCL with each rank on its own GPU (two needed).
Each rank runs one logical rank of a 2-way data-parallel step, in every
backward mode; the weights after three steps must equal one process running
both logical ranks in order (the reference), on every rank.
"""

from __future__ import annotations

import copy
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from tests.trainer.models import batch, tiny_qwen3
from tests.trainer.test_backward_state import sft_loss
from trainer_core.run.distributed import log, run_rank_process
from trainer_core.training import OptimizerConfig, Trainer

MODES = ("retain", "offload", "replay")
CONFIG = OptimizerConfig(learning_rate=1e-2, weight_decay=0.01, grad_clip=1.0)


def trainer_on(model) -> Trainer:
    trainer = Trainer(model)
    trainer.add_base_checkpoint(optimizer=CONFIG)
    return trainer


def main() -> None:
    device_type = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device, backend = f"cuda:{local}", "nccl"
    else:
        device, backend = "cpu", "gloo"
    model = tiny_qwen3(seed=0).train().to(device)  # seeded: every rank starts from the same weights
    reference = copy.deepcopy(model)

    # The reference, before the process group exists: this process alone, both logical ranks in order.
    single = trainer_on(reference)
    for step, mode in enumerate(MODES):
        for logical in range(world_size):
            ids, mask = (t.to(device) for t in batch(seed=10 * step + logical))
            single.backward(sft_loss(single.forward(ids, mask, mode=mode).logprobs, mask) / world_size)
        single.step()

    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    trainer = trainer_on(model)
    for step, mode in enumerate(MODES):
        ids, mask = (t.to(device) for t in batch(seed=10 * step + rank))
        out = trainer.forward(ids, mask, mode=mode)
        trainer.backward(sft_loss(out.logprobs, mask) / world_size)
        assert trainer.step()["base"].stepped
    log(f"rank {rank}: three data-parallel steps over {backend} done")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    log(f"OK rank {rank} {device_type} data-parallel steps equal one process running both logical ranks")


if __name__ == "__main__":
    run_rank_process(main)
