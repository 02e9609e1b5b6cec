"""Tokens/s of a training segment at W = 2 processes vs W = 1, for the same L = 4 logical ranks.

    python -m bench.rank_scaling [--reps 3] [--steps 6] [--quick]

Four configurations, interleaved round by round (the machine's drift hits
all alike), medians over rounds of each launch's median step:

- deterministic (the default): `train.threads_per_process` = 1 at both W,
  so the weights are bitwise the same (checked: the losses must match);
  W = 1 leaves the second core idle — that is the price of the guarantee on
  one process, and W = 2 gets it back.
- fast: a plain all-reduce, and the launcher's cores / W threads, so both W
  use every core (W = 1 runs 2 threads); the last bits then depend on W.

The headline `ratio` is deterministic W = 2 over W = 1; `fast.ratio` is the
same for fast, and `deterministic_over_fast` compares the two at each W.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from bench._models import emit
from bench._segments import machine, parse_segment_args, plan_run, run_segment

SIDES = (("deterministic", 1), ("deterministic", 2), ("fast", 1), ("fast", 2))


def main(argv: list[str] | None = None) -> dict:
    args = parse_segment_args("python -m bench.rank_scaling", __doc__, "four launches", argv)
    with tempfile.TemporaryDirectory(prefix="bench-rank-scaling-") as tmp:
        run_dirs = {
            mode: plan_run(
                Path(tmp) / mode, steps=args.steps, logical_dp=4, quick=args.quick, train={"reduction": mode}
            )
            for mode in ("deterministic", "fast")
        }
        runs: dict[tuple[str, int], list[dict]] = {side: [] for side in SIDES}
        for round_index in range(args.reps):
            for mode, world_size in SIDES:
                figures = run_segment(run_dirs[mode], world_size)
                runs[(mode, world_size)].append(figures)
                print(
                    f"round {round_index + 1}/{args.reps} {mode} W={world_size} "
                    f"({figures['threads_per_process']} thread(s)/process): {figures['tokens_per_s']:.0f} tokens/s",
                    flush=True,
                )

    def side(mode: str, world_size: int) -> dict:
        launches = runs[(mode, world_size)]
        return {
            "name": f"{mode} W={world_size}",
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in launches),
            "tokens_per_s_per_round": [round(r["tokens_per_s"], 1) for r in launches],
            "threads_per_process": launches[0]["threads_per_process"],
            "losses": launches[0]["losses"],
        }

    sides = {key: side(*key) for key in SIDES}
    deterministic_equal = sides[("deterministic", 1)]["losses"] == sides[("deterministic", 2)]["losses"]
    if not deterministic_equal:
        raise AssertionError("deterministic losses differ between W = 1 and W = 2: the guarantee is broken")
    baseline, candidate = sides[("deterministic", 1)], sides[("deterministic", 2)]
    fast_1, fast_2 = sides[("fast", 1)], sides[("fast", 2)]
    result = {
        "bench": "rank_scaling",
        "metric": "tokens_per_s (median over rounds of each launch's median step)",
        "baseline": baseline,
        "candidate": candidate,
        "ratio": candidate["tokens_per_s"] / baseline["tokens_per_s"],
        "higher_is_better": True,
        "logical_dp": 4,
        "fast": {
            "baseline": fast_1,
            "candidate": fast_2,
            "ratio": fast_2["tokens_per_s"] / fast_1["tokens_per_s"],
            "losses_equal_across_w": fast_1["losses"] == fast_2["losses"],
        },
        "deterministic_over_fast": {
            f"W={w}": sides[("deterministic", w)]["tokens_per_s"] / sides[("fast", w)]["tokens_per_s"] for w in (1, 2)
        },
        "deterministic_losses_equal_across_w": deterministic_equal,
        "reps": args.reps,
        "steps": args.steps,
        "quick": args.quick,
        "machine": machine(),
    }
    print(
        f"deterministic W=2/W=1 {result['ratio']:.2f}x, fast {result['fast']['ratio']:.2f}x; "
        f"deterministic/fast at W=1 {result['deterministic_over_fast']['W=1']:.2f}, "
        f"at W=2 {result['deterministic_over_fast']['W=2']:.2f}",
        flush=True,
    )
    emit(result)
    return result


if __name__ == "__main__":
    main()
