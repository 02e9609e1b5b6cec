"""Run under torchrun by bench.ddp_parity: a plain DDP loop and a segment's step loop, the same job, interleaved.

Every side gets a copy of one model (`bench._models.ModelSpec`) and sees the
same global batch each round:

- `ddp`: torch's `DistributedDataParallel` over gloo, the step a user writes
  (forward, masked cross-entropy, backward with DDP's bucketed all-reduce,
  `clip_grad_norm_`, `torch.optim.AdamW`);
- `fast` and `deterministic`: the loop of a segment (`trainer_core.run.segment`):
  `steps.train_step` over the logical ranks of `LogicalDataParallel`, then
  `ldp.step`, with that `train.reduction`.

Rank 0 times each step between barriers (the slower rank sets the pace), and
its own CPU seconds (a loaded machine stretches wall time, barely CPU time), and
splits the steps by where their seconds went (`PhaseClock`; DDP's all-reduce
runs inside its backward, so its fold counts as forward/backward).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from bench._models import BETAS, EPS, GRAD_CLIP, LEARNING_RATE, ModelSpec, make_batch
from bench._phase_clock import PhaseClock
from trainer_core.objectives.sft import SFT
from trainer_core.ranks import LogicalDataParallel, Topology, pin_threads
from trainer_core.ranks import logical_gradients as logical_gradients
from trainer_core.run import steps
from trainer_core.run.distributed import init_distributed, run_rank_process
from trainer_core.run.figures import FigureLayout
from trainer_core.run.steps import train_step
from trainer_core.training import OptimizerConfig, Trainer
from trainer_core.training import gradient_reduction as gradient_reduction

SIDES = ("ddp", "fast", "deterministic")


def shard_rows(step: int, args: argparse.Namespace, vocab_size: int) -> dict[str, torch.Tensor]:
    """The global batch of `step` in the shard contract (`data/shards.py`): bool masks, targets aligned per token."""
    batch = make_batch(step, args.batch_size, args.seq_len, vocab_size)
    loss_mask = torch.zeros_like(batch.input_ids, dtype=torch.bool)
    loss_mask[:, 1:] = batch.loss_mask.bool()
    return {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask.bool(), "loss_mask": loss_mask}


class DDPLoop:
    def __init__(self, model: torch.nn.Module, clock: PhaseClock):
        self.clock = clock
        self.model = DistributedDataParallel(model)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=BETAS, eps=EPS, weight_decay=0.0)

    def step(self, rows: dict[str, torch.Tensor], topology: Topology, step: int) -> float:
        started = time.perf_counter()
        num_loss_tokens = int(rows["loss_mask"][:, 1:].sum())
        mine = topology.logical_row_ranges(rows["input_ids"].shape[0])[topology.rank]  # L = W: one slice each
        ids, targets = rows["input_ids"][mine.start : mine.stop], rows["loss_mask"][mine.start : mine.stop, 1:]
        logits = self.model(input_ids=ids, attention_mask=rows["attention_mask"][mine.start : mine.stop]).logits
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        loss_sum = (nll.view_as(targets) * targets).sum()
        # DDP averages gradients over W: scaled by W, the step is the gradient of the global-batch loss.
        (loss_sum * topology.world_size / num_loss_tokens).backward()  # DDP's all-reduce overlaps it
        stepping = time.perf_counter()
        self.clock.charge("forward_backward", stepping - started)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.clock.charge("optimizer", time.perf_counter() - stepping)
        total = loss_sum.detach().double()
        dist.all_reduce(total)
        return float(total) / num_loss_tokens


class SegmentLoop:
    """A segment's step, as `SegmentRun.train_steps` runs it."""

    def __init__(self, model: torch.nn.Module, topology: Topology, reduction: str):
        self.trainer = Trainer(model)
        self.trainer.add_base_checkpoint(
            optimizer=OptimizerConfig(
                learning_rate=LEARNING_RATE, betas=BETAS, eps=EPS, weight_decay=0.0, grad_clip=GRAD_CLIP
            )
        )
        self.model = model
        self.ldp = LogicalDataParallel(self.trainer, topology, reduction=reduction, seed=1)
        self.objective = SFT()
        self.layout = FigureLayout.for_objective(self.objective.figures)

    def step(self, rows: dict[str, torch.Tensor], topology: Topology, step: int) -> float:
        (base,) = self.trainer.checkpoints.values()
        sums = train_step(self.ldp, self.objective, self.layout, rows, step, base.revision, "retain")
        self.ldp.step(learning_rate=LEARNING_RATE)
        return sums["loss_sum"] / int(rows["loss_mask"][:, 1:].sum())


def instrument(clock: PhaseClock) -> None:
    """Charge the rankflow step's seconds to its phases (exclusive: a phase inside another is not counted twice)."""
    clock.wrap(dist, "all_gather_object", "coordination")  # status exchanges, step agreement, the figures' gather
    clock.wrap(logical_gradients.LogicalGradients, "reduce", "fold")  # deterministic: ordered fold; fast: all-reduce
    clock.wrap(gradient_reduction.RankSum, "reduce", "fold")
    clock.wrap(Trainer, "step", "optimizer")  # norm, clip and AdamW: what the other phases leave of the step
    clock.wrap(steps, "logical_rank_work", "forward_backward")  # forward, objective, backward of a logical rank


def measure(args: argparse.Namespace, topology: Topology) -> dict:
    spec = ModelSpec(**json.loads(args.spec))
    model = spec.build(seed=0)
    clock = PhaseClock()
    instrument(clock)
    deterministic = SegmentLoop(copy.deepcopy(model), topology, "deterministic")
    loops: dict[str, Callable] = {
        "ddp": DDPLoop(copy.deepcopy(model), clock).step,
        "fast": SegmentLoop(copy.deepcopy(model), topology, "fast").step,
        "deterministic": deterministic.step,
    }
    figures: dict = {side: {"step_s": [], "cpu_s": [], "losses": [], "phases_s": []} for side in SIDES}
    for round_index in range(args.warmup + args.reps):
        rows = shard_rows(round_index, args, spec.vocab_size)
        for side in SIDES:
            dist.barrier()
            clock.reset()
            cpu_started, started = time.process_time(), time.perf_counter()
            loss = loops[side](rows, topology, round_index)
            cpu = time.process_time() - cpu_started  # before the barrier: this rank's own work, not its wait
            dist.barrier()
            elapsed = time.perf_counter() - started
            figures[side]["losses"].append(loss)
            if round_index >= args.warmup:
                figures[side]["step_s"].append(elapsed)
                figures[side]["cpu_s"].append(cpu)
                figures[side]["phases_s"].append(clock.phases(elapsed))
            if topology.rank == 0:
                print(f"round {round_index} {side}: {elapsed:.3f} s, loss {loss:.6f}", flush=True)
    return {
        "sides": figures,
        "num_params": sum(p.numel() for p in model.parameters()),
        "world_size": topology.world_size,
        "tokens_per_step": args.batch_size * args.seq_len,
        "threads_per_process": torch.get_num_threads(),
        # Whether the deterministic fold overlapped the last backward (rounds folded, buckets sent mid-backward).
        "overlap_counts": getattr(deterministic.ldp.gradients, "overlap_counts", None),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--spec", default="{}")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    args = parser.parse_args()
    pin_threads(1)  # one core per process, both sides alike (the deterministic default; 2 processes, 2 cores)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # L = W: one logical rank per process, as DDP splits
    topology = init_distributed(logical_dp=world_size, timeout_s=600, global_batch_size=args.batch_size)
    figures = measure(args, topology)
    if topology.rank == 0:
        args.out.write_text(json.dumps(figures))


if __name__ == "__main__":
    run_rank_process(main)
