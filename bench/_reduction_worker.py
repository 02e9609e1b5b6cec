"""Run under torchrun by bench.deterministic_reduction: one gradient reduction, deterministic vs fast, interleaved.

The gradient is the size of a real model's (`bench._models.ModelSpec`), one
random partial per logical rank. The deterministic side is the step's
`LogicalGradients.reduce` (each logical rank's partial laid out and folded in
logical order by the sharded fold); the fast side is `RankSum.reduce` over the
same partials already summed locally (what `.grad` holds in fast mode: one
all-reduce). Rank 0 times each reduction between barriers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench._models import ModelSpec
from trainer_core.ranks import LogicalGradients, Topology, pin_threads
from trainer_core.run.distributed import init_distributed, run_rank_process
from trainer_core.training import Trainer
from trainer_core.training.gradient_reduction import RankSum


def _partials(checkpoint, logical_rank: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(logical_rank)
    return {name: torch.randn(p.shape, generator=generator) for name, p in checkpoint.parameters().items()}


def measure(trainer: Trainer, topology: Topology, reps: int, warmup: int) -> dict:
    checkpoint = trainer.checkpoints["base"]
    names = list(checkpoint.parameters())
    partials = {r: _partials(checkpoint, r) for r in topology.local_logical_ranks}
    local_sums = {name: sum(partials[r][name] for r in topology.local_logical_ranks) for name in names}
    flags = [[True] * len(names)]
    timings: dict[str, list[float]] = {"fast": [], "deterministic": []}
    folded_digests = set()
    for round_index in range(warmup + reps):
        for side in ("fast", "deterministic"):
            checkpoint.clear_gradients()
            if side == "deterministic":
                reduction = LogicalGradients(trainer, topology, "deterministic")
                for logical_rank in topology.local_logical_ranks:
                    with reduction.scope(logical_rank):
                        for name, param in checkpoint.parameters().items():
                            param.grad = partials[logical_rank][name]
            else:
                reduction = RankSum()
                for name, param in checkpoint.parameters().items():
                    param.grad = local_sums[name].clone()
            dist.barrier()
            started = time.perf_counter()
            reduction.reduce([checkpoint], flags)
            dist.barrier()
            elapsed = time.perf_counter() - started
            if round_index >= warmup:
                timings[side].append(elapsed)
            if side == "deterministic":
                folded_digests.add(hash(b"".join(p.grad.numpy().tobytes() for p in checkpoint.parameters().values())))
    return {"timings": timings, "same_bits_every_round": len(folded_digests) == 1}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--spec", default="{}")
    parser.add_argument("--logical-dp", default="2,4", help="comma-separated L values (multiples of W)")
    args = parser.parse_args()
    pin_threads(1)
    logical_dps = [int(value) for value in args.logical_dp.split(",")]
    topology = init_distributed(logical_dp=logical_dps[0], timeout_s=300)
    model = ModelSpec(**json.loads(args.spec)).build(seed=0)
    trainer = Trainer(model)
    trainer.add_base_checkpoint()
    figures = {"num_params": sum(p.numel() for p in model.parameters()), "world_size": topology.world_size, "cases": {}}
    for logical_dp in logical_dps:
        case = Topology(topology.rank, topology.world_size, logical_dp)
        figures["cases"][str(logical_dp)] = measure(trainer, case, args.reps, args.warmup)
    if topology.rank == 0:
        args.out.write_text(json.dumps(figures))


if __name__ == "__main__":
    run_rank_process(main)
