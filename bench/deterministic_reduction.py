"""What determinism costs at the step: the ordered (sharded) fold vs a plain all-reduce of the same gradient.

    python -m bench.deterministic_reduction [--reps 8] [--quick]

W = 2 processes reduce the gradient of the 21M-parameter benchmark model
(`bench._models.ModelSpec`) over L = 2 and L = 4 logical ranks, the two sides
alternating (`bench/_reduction_worker.py`). The figure is reductions per
second, deterministic over fast (higher is better; 1 would be free), for
L = 4 (two logical ranks per process: the all-to-all carries both partials,
where an all-reduce carries their sum); `L=2` is the L = W case, where both
move the same bytes. The end-to-end cost, in a training step with everything
else, is `deterministic_over_fast` of `bench.rank_scaling`.
"""

from __future__ import annotations

import argparse
import json
import statistics

from bench._models import emit
from bench._segments import machine
from bench._worker_launch import worker_figures


def _case(figures: dict) -> dict:
    fast, deterministic = (statistics.median(figures["timings"][side]) for side in ("fast", "deterministic"))
    return {
        "baseline": {"name": "fast (all-reduce)", "reduce_s_median": fast, "reductions_per_s": 1 / fast},
        "candidate": {
            "name": "deterministic (ordered sharded fold)",
            "reduce_s_median": deterministic,
            "reductions_per_s": 1 / deterministic,
        },
        "ratio": fast / deterministic,
        "same_bits_every_round": figures["same_bits_every_round"],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m bench.deterministic_reduction", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="smoke run: a small gradient, 2 reps")
    args = parser.parse_args(argv)
    spec = {"hidden_size": 128, "num_layers": 2, "intermediate_size": 384, "vocab_size": 1024} if args.quick else {}
    reps = 2 if args.quick else args.reps
    figures = worker_figures("bench._reduction_worker", ["--reps", str(reps), "--spec", json.dumps(spec)], world_size=2)
    cases = {f"L={logical_dp}": _case(case) for logical_dp, case in figures["cases"].items()}
    headline = cases["L=4"]
    report = {
        "bench": "deterministic_reduction",
        "metric": "gradient reductions per second (median)",
        "baseline": headline["baseline"],
        "candidate": headline["candidate"],
        "ratio": headline["ratio"],
        "higher_is_better": True,
        "cases": cases,
        "num_params": figures["num_params"],
        "world_size": figures["world_size"],
        "reps": reps,
        "quick": args.quick,
        "machine": machine(),
    }
    for name, case in cases.items():
        print(
            f"{name}: deterministic {case['candidate']['reduce_s_median'] * 1000:.1f} ms vs fast "
            f"{case['baseline']['reduce_s_median'] * 1000:.1f} ms per reduction: ratio {case['ratio']:.2f}",
            flush=True,
        )
    emit(report)
    return report


if __name__ == "__main__":
    main()
