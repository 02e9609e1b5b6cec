"""A segment's step vs a plain DDP loop: the same model, batch and AdamW on 2 gloo processes, interleaved.

    python -m bench.ddp_parity [--reps 5] [--tokens 1024,4096] [--quick]

The worker (`bench/_ddp_parity_worker.py`) runs three sides round by round
on the 21M-parameter benchmark model (`bench._models.ModelSpec`, a global
batch of 4 rows, 4 × 1024 tokens unless `--tokens` says otherwise, one thread
per process; `--tokens 1024,4096` runs each size in turn): torch's
`DistributedDataParallel`, and a segment's loop with `train.reduction =
"fast"` and `"deterministic"`. The figure is DDP's step time over the
segment's (higher is better; 1 is parity): targets ≥ 0.9 fast, ≥ 0.8
deterministic; beside it the median of each round's own ratio (`paired_ratio`)
and the ratio of rank 0's CPU seconds (`cpu_ratio`), which a loaded machine
stretches less. Each rankflow side's median step is split into
forward/backward, fold, coordination, optimizer and other (DDP's into
forward/backward, its all-reduce overlapped inside, and optimizer); the step-0
losses of the three sides are printed too (the same job: they agree to
float32 rounding).
"""

from __future__ import annotations

import argparse
import json
import statistics

from bench._models import emit
from bench._segments import machine
from bench._worker_launch import worker_figures

QUICK_SPEC = {"hidden_size": 128, "num_layers": 2, "intermediate_size": 384, "vocab_size": 1024}
PHASES = ("forward_backward", "fold", "coordination", "optimizer", "other")
BATCH_ROWS = 4


def median_phases(per_step: list[dict[str, float]]) -> dict[str, float]:
    """Each phase's median over the timed steps (a phase a step never entered counts 0 s there)."""
    return {phase: statistics.median(step.get(phase, 0.0) for step in per_step) for phase in PHASES}


def side_summary(name: str, side: dict, tokens_per_step: int) -> dict:
    step_s = statistics.median(side["step_s"])
    summary = {
        "name": name,
        "step_s_median": step_s,
        "step_s": side["step_s"],
        "cpu_s_median": statistics.median(side["cpu_s"]),
        "tokens_per_s": tokens_per_step / step_s,
        "step_0_loss": side["losses"][0],
    }
    summary["phases_s_median"] = median_phases(side["phases_s"])
    return summary


def report(figures: dict, *, reps: int, quick: bool) -> dict:
    tokens = figures["tokens_per_step"]
    sides = figures["sides"]
    ddp = side_summary("torch DistributedDataParallel", sides["ddp"], tokens)
    rankflow = {
        mode: side_summary(f"segment loop, reduction = {mode!r}", sides[mode], tokens)
        for mode in ("fast", "deterministic")
    }
    ratios = {mode: ddp["step_s_median"] / side["step_s_median"] for mode, side in rankflow.items()}
    # Each round ran the sides back to back: the median of the rounds' own ratios shrugs off the machine's drift.
    paired = {
        mode: statistics.median(b / c for b, c in zip(sides["ddp"]["step_s"], sides[mode]["step_s"], strict=True))
        for mode in rankflow
    }
    cpu = {mode: ddp["cpu_s_median"] / side["cpu_s_median"] for mode, side in rankflow.items()}
    return {
        "bench": "ddp_parity",
        "metric": "DDP step time / segment step time (median; higher is better, 1 = parity)",
        "baseline": ddp,
        "candidate": rankflow["fast"],
        "ratio": ratios["fast"],
        "higher_is_better": True,
        "paired_ratio": paired["fast"],
        "cpu_ratio": cpu["fast"],
        "deterministic": {
            "candidate": rankflow["deterministic"],
            "ratio": ratios["deterministic"],
            "paired_ratio": paired["deterministic"],
            "cpu_ratio": cpu["deterministic"],
        },
        "targets": {"fast": 0.9, "deterministic": 0.8},
        "num_params": figures["num_params"],
        "world_size": figures["world_size"],
        "tokens_per_step": tokens,
        "threads_per_process": figures["threads_per_process"],
        "overlap_counts": figures.get("overlap_counts"),
        "reps": reps,
        "quick": quick,
        "machine": machine(),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.ddp_parity", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="timed rounds (each runs every side once)")
    parser.add_argument(
        "--tokens",
        default=str(BATCH_ROWS * 1024),
        help="tokens a step (global batch), comma-separated for several sizes in turn; each a multiple of 4",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: a small model, 128 tokens a row, 2 rounds")
    args = parser.parse_args(argv)
    try:
        sizes = [int(size) for size in args.tokens.split(",")] if not args.quick else [BATCH_ROWS * 128]
    except ValueError:
        sizes = [0]
    if any(size <= 0 or size % BATCH_ROWS for size in sizes):
        parser.error(
            f"--tokens {args.tokens}: each size must be a positive multiple of {BATCH_ROWS} (the batch's rows)"
        )
    results = [run_size(size, args) for size in sizes]
    if len(results) > 1:
        for result in results:
            print(
                f"{result['tokens_per_step']} tokens a step: fast {result['ratio']:.2f}, "
                f"deterministic {result['deterministic']['ratio']:.2f}",
                flush=True,
            )
    result = {**results[0], "sizes": results[1:]} if len(results) > 1 else results[0]
    emit(result)
    return result


def run_size(tokens: int, args: argparse.Namespace) -> dict:
    """One size's three sides, interleaved, and their report (printed as it comes)."""
    reps = 2 if args.quick else args.reps
    worker_args = ["--reps", str(reps), "--spec", json.dumps(QUICK_SPEC if args.quick else {})]
    worker_args += ["--batch-size", str(BATCH_ROWS), "--seq-len", str(tokens // BATCH_ROWS)]
    figures = worker_figures("bench._ddp_parity_worker", worker_args, world_size=2, echo=True)
    result = report(figures, reps=reps, quick=args.quick)
    for mode, figures_of_mode in (("fast", result), ("deterministic", result["deterministic"])):
        side = figures_of_mode["candidate"]
        phases = ", ".join(f"{phase} {seconds * 1000:.0f} ms" for phase, seconds in side["phases_s_median"].items())
        print(
            f"{mode}: {side['step_s_median']:.3f} s/step vs DDP {result['baseline']['step_s_median']:.3f} s: "
            f"ratio {figures_of_mode['ratio']:.2f}, paired {figures_of_mode['paired_ratio']:.2f}, "
            f"CPU {figures_of_mode['cpu_ratio']:.2f} ({phases})",
            flush=True,
        )
    ddp_phases = ", ".join(
        f"{phase} {seconds * 1000:.0f} ms" for phase, seconds in result["baseline"]["phases_s_median"].items()
    )
    print(f"DDP: {result['baseline']['step_s_median']:.3f} s/step ({ddp_phases})", flush=True)
    print(f"deterministic fold overlapped with backward: {result['overlap_counts']}", flush=True)
    print(
        "step-0 loss: DDP {:.6f}, fast {:.6f}, deterministic {:.6f}".format(
            result["baseline"]["step_0_loss"],
            result["candidate"]["step_0_loss"],
            result["deterministic"]["candidate"]["step_0_loss"],
        ),
        flush=True,
    )
    return result


if __name__ == "__main__":
    main()
