"""Run under torchrun (W = 2, 4) by test_logical_ranks, and in-process at W = 1: every scenario at L = 4.

Writes, from rank 0, `OUT/results-wW.json`: per scenario the per-step losses
and the digest of the final weights (every rank checks it holds the same).
With `--fast`, only the even SPMD run with `reduction="fast"` (a plain
all-reduce), into `OUT/fast.json`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

import trainer_core.ranks.fold_buckets as fold_buckets
from tests.ranks.loops import (
    EVEN_ROWS,
    LOGICAL_DP,
    UNEVEN_ROWS,
    digest,
    make_trainer,
    rank_zero_shuffled,
    rl_batches,
    rl_loop,
    sft_batches,
    sft_loop,
    shuffle_pool,
    spmd_sft,
    spmd_shuffled,
)
from tests.ranks.overlapped_loops import spmd_overlapped
from trainer_core.ranks import Topology, pin_threads, reduce_over_logical_ranks, run_rank_zero
from trainer_core.ranks.reduction import sharded_ordered_fold, to_shard_layout
from trainer_core.run.distributed import init_distributed, log, run_rank_process

# The overlapped fold at the tiny model's size: buckets of about one weight each, so many leave mid-backward.
OVERLAPPED = (
    ("overlapped_even", EVEN_ROWS, {}),
    ("overlapped_uneven", UNEVEN_ROWS, {}),
    ("overlapped_micro", EVEN_ROWS, {"micro": 2}),
    ("overlapped_extra_backward", EVEN_ROWS, {"extra": True}),
    ("overlapped_edited_after", EVEN_ROWS, {"edit": True}),
    ("overlapped_failed_then_retried", EVEN_ROWS, {"fail": True}),
)


def _partial(logical_rank: int, numel: int = 1001) -> torch.Tensor:
    # Magnitudes 1e-3 … 1e3 apart: any other association of the sum changes the last bits.
    generator = torch.Generator().manual_seed(100 + logical_rank)
    return torch.randn(numel, generator=generator) * 10.0 ** (3 * ((logical_rank % 3) - 1))


def _same_everywhere(value: str, topology: Topology) -> str:
    if topology.world_size > 1:
        gathered: list = [None] * topology.world_size
        dist.all_gather_object(gathered, value)
        assert len(set(gathered)) == 1, f"ranks disagree: {gathered}"
    return value


def run_scenarios(topology: Topology) -> dict[str, dict]:
    results: dict[str, dict] = {}

    def record(name: str, trainer, losses) -> None:
        results[name] = {"losses": losses, "digest": _same_everywhere(digest(trainer), topology)}

    trainer = make_trainer()
    record("spmd_even", trainer, spmd_sft(trainer, topology, sft_batches(EVEN_ROWS)))
    trainer = make_trainer()
    record("spmd_uneven", trainer, spmd_sft(trainer, topology, sft_batches(UNEVEN_ROWS)))
    trainer = make_trainer()
    record(
        "spmd_uneven_skipping_empty", trainer, spmd_sft(trainer, topology, sft_batches(UNEVEN_ROWS), yield_empty=False)
    )
    trainer = make_trainer()
    record("rank_zero_sft", trainer, run_rank_zero(trainer, topology, lambda t: sft_loop(t, sft_batches(UNEVEN_ROWS))))
    trainer = make_trainer()
    record("rank_zero_rl", trainer, run_rank_zero(trainer, topology, lambda t: rl_loop(t, rl_batches())))
    trainer = make_trainer()
    record("spmd_shuffled", trainer, spmd_shuffled(trainer, topology, shuffle_pool()))
    trainer = make_trainer()
    record(
        "rank_zero_shuffled", trainer, run_rank_zero(trainer, topology, lambda t: rank_zero_shuffled(t, shuffle_pool()))
    )

    overlap: dict[str, dict] = {}
    for name, rows, options in OVERLAPPED:
        trainer = make_trainer()
        losses, overlap[name] = spmd_overlapped(trainer, topology, sft_batches(rows), **options)
        record(name, trainer, losses)
    if topology.world_size > 1:  # nothing to overlap at W = 1
        results["overlap_counts"] = overlap

    local = torch.stack([_partial(r) for r in topology.local_logical_ranks])
    folded = sharded_ordered_fold(to_shard_layout(local, topology.world_size), topology)[: local.shape[1]]
    results["fold"] = {"digest": _same_everywhere(folded.numpy().tobytes().hex(), topology)}
    values = {
        r: torch.tensor([1e8, 1.0 / (r + 3)], dtype=torch.float32) * (-1) ** r
        for r in topology.local_logical_ranks
        if r != 2
    }  # logical rank 2 has no value
    reduced = reduce_over_logical_ranks(values, "sum", topology)
    results["reduce"] = {"digest": _same_everywhere(reduced.numpy().tobytes().hex(), topology)}
    return results


def fast_scenario(topology: Topology) -> dict:
    trainer = make_trainer()
    losses = spmd_sft(trainer, topology, sft_batches(EVEN_ROWS), reduction="fast")
    return {"losses": losses, "digest": digest(trainer)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--fast", action="store_true")
    args = parser.parse_args()
    pin_threads(1)
    fold_buckets.BUCKET_BYTES = 4096
    topology = init_distributed(logical_dp=LOGICAL_DP, timeout_s=120)
    results = fast_scenario(topology) if args.fast else run_scenarios(topology)
    name = "fast.json" if args.fast else f"results-w{topology.world_size}.json"
    if topology.rank == 0:
        (args.out / name).write_text(json.dumps(results, indent=2))
    log(f"OK rank {topology.rank} of {topology.world_size}")


if __name__ == "__main__":
    run_rank_process(main)
