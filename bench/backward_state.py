"""Backward state: peak resident saved-tensor bytes and tokens/s of retain, replay and offload.

Three trainers train copies of one model from identical weights on the same
batches, one per mode, stepping in turn (retain, replay, offload, retain, …).
Baseline = retain (saved tensors stay resident), candidate = replay (inputs
and RNG kept, the forward re-run in backward); offload (saved tensors moved
out — to disk on a CPU-only machine — and read back in backward) is reported
alongside. Saved bytes are the trainer's own accounting: the saved-tensor
bytes a live graph keeps resident between its forward and its backward.

    python -m bench.backward_state            # 4×1024, 4 reps (≈2.5 min on 2 CPU cores)
    python -m bench.backward_state --quick    # smoke test
"""

from __future__ import annotations

import argparse

from bench._models import (
    Timings,
    TrainerLoop,
    add_model_args,
    emit,
    fresh_copies,
    interleave,
    make_batch,
    max_abs_delta,
    model_summary,
    paired_ratio,
    side_figures,
    spec_from_args,
)

TARGET_SAVED_BYTES_RATIO = 0.10
TARGET_TOKENS_PER_S_RATIO = 0.70
MODES = ("retain", "replay", "offload")


def _side(loop: TrainerLoop, timings: Timings, num_tokens: int) -> dict:
    side = {"mode": loop.mode, **side_figures(timings, num_tokens), "peak_saved_bytes": loop.trainer.peak_saved_bytes}
    if loop.mode == "offload":
        side["offloaded_bytes_per_step"] = loop.offloaded_bytes
        side["offload_target"] = loop.trainer.offload_target
    return side


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.backward_state", description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.set_defaults(reps=4)
    args = parser.parse_args(argv)
    spec = spec_from_args(args)
    model = spec.build(seed=0).to(args.device)
    summary = model_summary(spec, model)
    print(f"model: {summary}", flush=True)
    loops = {mode: TrainerLoop(copy, mode) for mode, copy in zip(MODES, fresh_copies(model, len(MODES)))}
    del model

    def batches(index: int):
        return make_batch(index, args.batch_size, args.seq_len, spec.vocab_size, args.device)

    timings = interleave(
        {mode: loop.step for mode, loop in loops.items()},
        batches,
        warmup=args.warmup,
        reps=args.reps,
        label=f"[{args.batch_size}x{args.seq_len}] ",
    )
    num_tokens = args.batch_size * args.seq_len
    sides = {mode: _side(loop, timings[mode], num_tokens) for mode, loop in loops.items()}
    losses = {mode: timings[mode].losses for mode in MODES}
    baseline, candidate, offload = sides["retain"], sides["replay"], sides["offload"]
    saved_bytes_ratio = candidate["peak_saved_bytes"] / baseline["peak_saved_bytes"]
    tokens_per_s_ratio = candidate["tokens_per_s"] / baseline["tokens_per_s"]
    result = {
        "bench": "backward_state",
        "baseline": baseline,
        "candidate": candidate,
        "offload": offload,
        "ratio": tokens_per_s_ratio,
        "higher_is_better": True,
        "metric": "tokens_per_s (median step)",
        "tokens_per_s_ratio": tokens_per_s_ratio,
        "paired_tokens_per_s_ratio": paired_ratio(timings["retain"], timings["replay"]),
        "cpu_tokens_per_s_ratio": candidate["tokens_per_cpu_s"] / baseline["tokens_per_cpu_s"],
        "saved_bytes_ratio": saved_bytes_ratio,
        "saved_bytes_higher_is_better": False,
        "offload_tokens_per_s_ratio": offload["tokens_per_s"] / baseline["tokens_per_s"],
        "offload_saved_bytes_ratio": offload["peak_saved_bytes"] / baseline["peak_saved_bytes"],
        "targets": {
            "saved_bytes_ratio_max": TARGET_SAVED_BYTES_RATIO,
            "tokens_per_s_ratio_min": TARGET_TOKENS_PER_S_RATIO,
        },
        "meets_target": saved_bytes_ratio <= TARGET_SAVED_BYTES_RATIO
        and tokens_per_s_ratio >= TARGET_TOKENS_PER_S_RATIO,
        "max_abs_delta_loss_vs_retain": {mode: max_abs_delta(losses["retain"], losses[mode]) for mode in MODES[1:]},
        "losses": losses,
        "batch": [args.batch_size, args.seq_len],
        "reps": args.reps,
        "warmup": args.warmup,
        "model": summary,
        "quick": args.quick,
    }
    print(
        f"replay/retain: saved bytes {saved_bytes_ratio:.4f} (target ≤ {TARGET_SAVED_BYTES_RATIO}), tokens/s "
        f"{tokens_per_s_ratio:.3f} (target ≥ {TARGET_TOKENS_PER_S_RATIO}); offload/retain tokens/s "
        f"{result['offload_tokens_per_s_ratio']:.3f}",
        flush=True,
    )
    emit(result)
    return result


if __name__ == "__main__":
    main()
