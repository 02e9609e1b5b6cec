"""Run under torchrun by bench.rank_zero_overhead: the same SFT steps as SPMD code and through the rank-zero facade.

Two identical trainers; each round runs one step of each side on the same
global batch (SPMD first, then rank-zero: a fresh facade session per step, so
its start and close count against it). Rank 0 times each step (every step
ends in collectives, so its wall time is the slowest rank's) and writes the
figures to OUT.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import time
from pathlib import Path

from bench._models import ModelSpec, make_batch
from trainer_core.ranks import LogicalDataParallel, pin_threads, run_rank_zero
from trainer_core.run.distributed import init_distributed, log, run_rank_process
from trainer_core.training import OptimizerConfig, Trainer


def _trainer(model) -> Trainer:
    trainer = Trainer(model)
    trainer.add_base_checkpoint(optimizer=OptimizerConfig(learning_rate=1e-4, grad_clip=1.0))
    return trainer


def spmd_step(ldp: LogicalDataParallel, batch, step: int) -> float:
    trainer = ldp.trainer
    num_loss_tokens = float(batch.loss_mask.sum())
    sums = {}
    for shard in ldp.forward_batches(
        {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "loss_mask": batch.loss_mask}, step=step
    ):
        with shard:
            out = trainer.forward(shard.rows["input_ids"], shard.rows["attention_mask"])
            loss_sum = -(out.logprobs * shard.rows["loss_mask"]).sum()
            trainer.backward(loss_sum / num_loss_tokens)
            sums[shard.logical_rank] = loss_sum.detach()
    loss = float(ldp.reduce(sums, "sum")) / num_loss_tokens
    ldp.step()
    return loss


def one_process_step(trainer, batch) -> float:
    """What a single-process user writes; run through the rank-zero facade."""
    out = trainer.forward(batch.input_ids, batch.attention_mask)
    loss = -(out.logprobs * batch.loss_mask).sum() / batch.loss_mask.sum()
    trainer.backward(loss)
    trainer.step()
    return loss.item()


def digest(trainer) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in trainer.model.parameters())).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--logical-dp", type=int, default=4)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--spec", default="{}", help="ModelSpec fields as JSON")
    args = parser.parse_args()
    pin_threads(1)
    topology = init_distributed(logical_dp=args.logical_dp, timeout_s=300)
    spec = ModelSpec(**json.loads(args.spec))
    model = spec.build(seed=0)
    spmd = LogicalDataParallel(_trainer(model), topology, seed=0)
    rank_zero_trainer = _trainer(copy.deepcopy(model))
    timings = {"spmd": [], "rank_zero": []}
    losses = {"spmd": [], "rank_zero": []}
    for round_index in range(args.warmup + args.reps):
        batch = make_batch(round_index, args.batch_size, args.seq_len, spec.vocab_size)
        for side in ("spmd", "rank_zero"):
            started = time.perf_counter()
            if side == "spmd":
                loss = spmd_step(spmd, batch, round_index)
            else:
                loss = run_rank_zero(rank_zero_trainer, topology, lambda t: one_process_step(t, batch), seed=0)
            elapsed = time.perf_counter() - started
            if round_index >= args.warmup:
                timings[side].append(elapsed)
            losses[side].append(loss)
            if topology.rank == 0:
                log(f"round {round_index} {side}: {elapsed:.3f} s, loss {loss:.6f}")
    if topology.rank == 0:
        args.out.write_text(
            json.dumps(
                {
                    "timings": timings,
                    "losses": losses,
                    "num_tokens": args.batch_size * args.seq_len,
                    "weights_equal": digest(spmd.trainer) == digest(rank_zero_trainer),
                    "num_params": sum(p.numel() for p in model.parameters()),
                    "world_size": topology.world_size,
                    "logical_dp": args.logical_dp,
                }
            )
        )


if __name__ == "__main__":
    run_rank_process(main)
