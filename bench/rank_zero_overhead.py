"""The rank-zero facade vs SPMD code on the same work: tokens/s of one SFT step, W = 2 processes, L = 4.

    python -m bench.rank_zero_overhead [--reps 6] [--quick]

Both sides run in the same torchrun launch, alternating step by step on the
same global batches (`bench/_rank_zero_worker.py`): SPMD code over the
logical-DP facade (each process forwards its own logical ranks' rows), and a
loop written for one process, driven from rank 0 through the rank-zero
facade (rows scattered, logprobs gathered, cotangents scattered back). The
cotangents are the same bits on both sides, so the final weights must be
bitwise equal (checked). Target ratio ≥ 0.95.
"""

from __future__ import annotations

import argparse
import json
import statistics

from bench._models import emit
from bench._segments import machine
from bench._worker_launch import worker_figures

TARGET_RATIO = 0.95
SPEC = {"hidden_size": 256, "num_layers": 4, "intermediate_size": 768, "vocab_size": 4096}
"""≈ 5.3M parameters: a step of 8×256 tokens takes about a second on one core per process."""


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.rank_zero_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="smoke run: a tiny model, 2 reps")
    args = parser.parse_args(argv)
    spec, seq_len = (
        (SPEC, 256)
        if not args.quick
        else ({"hidden_size": 128, "num_layers": 2, "intermediate_size": 384, "vocab_size": 1024}, 64)
    )
    reps = 2 if args.quick else args.reps
    figures = worker_figures(
        "bench._rank_zero_worker",
        [
            "--reps",
            str(reps),
            "--warmup",
            str(args.warmup),
            "--seq-len",
            str(seq_len),
            "--spec",
            json.dumps(spec),
        ],
        world_size=args.world_size,
        echo=True,
    )
    num_tokens = figures["num_tokens"]

    def side(name: str) -> dict:
        step_s = statistics.median(figures["timings"][name])
        return {
            "name": name,
            "tokens_per_s": num_tokens / step_s,
            "step_s_median": step_s,
            "step_s": [round(s, 4) for s in figures["timings"][name]],
        }

    baseline, candidate = side("spmd"), side("rank_zero")
    paired = statistics.median(b / c for b, c in zip(figures["timings"]["spmd"], figures["timings"]["rank_zero"]))
    ratio = candidate["tokens_per_s"] / baseline["tokens_per_s"]
    report = {
        "bench": "rank_zero_overhead",
        "metric": "tokens_per_s (median step)",
        "baseline": baseline,
        "candidate": candidate,
        "ratio": ratio,
        "higher_is_better": True,
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio >= TARGET_RATIO,
        "paired_ratio": paired,
        "weights_equal": figures["weights_equal"],
        "losses": figures["losses"],
        "model": {**spec, "num_params": figures["num_params"]},
        "batch": [8, seq_len],
        "world_size": figures["world_size"],
        "logical_dp": figures["logical_dp"],
        "reps": reps,
        "quick": args.quick,
        "machine": machine(),
    }
    if not figures["weights_equal"]:
        raise AssertionError("the rank-zero facade and SPMD code ended with different weights")
    print(f"rank-zero / SPMD: {ratio:.3f} (paired {paired:.3f}; target ≥ {TARGET_RATIO})", flush=True)
    emit(report)
    return report


if __name__ == "__main__":
    main()
