"""Overhead of the trainer API: tokens/s of `Trainer` (mode="retain") against a plain PyTorch loop.

Both sides train the same Qwen3-style model from identical weights on the same
batches: forward → masked token NLL → backward → clip → AdamW → zero_grad.
The plain loop calls `model(...).logits` and `loss.backward()`; the trainer
goes through managed outputs, the two `autograd.grad` calls, staged
gradients and the per-checkpoint step. Steps alternate (plain, trainer,
plain, …) so drift in the machine's speed hits both sides alike; the loss of
every step is compared as a correctness check.

    python -m bench.trainer_overhead            # 4×1024, 5 reps (≈1 min on 2 CPU cores)
    python -m bench.trainer_overhead --long     # also 4×4096, 1 rep (≈80 s per step per side on 2 cores)
    python -m bench.trainer_overhead --quick    # smoke test
"""

from __future__ import annotations

import argparse

from bench._models import (
    PlainLoop,
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

TARGET_RATIO = 0.97


def run_case(
    plain: PlainLoop,
    trainer: TrainerLoop,
    *,
    batch_size: int,
    seq_len: int,
    vocab_size: int,
    warmup: int,
    reps: int,
    first_batch: int,
    device: str = "cpu",
) -> dict:
    def batches(index: int):
        return make_batch(first_batch + index, batch_size, seq_len, vocab_size, device)

    timings = interleave(
        {"plain": plain.step, "trainer": trainer.step},
        batches,
        warmup=warmup,
        reps=reps,
        label=f"[{batch_size}x{seq_len}] ",
    )
    num_tokens = batch_size * seq_len
    baseline = {"name": "plain_pytorch_loop", **side_figures(timings["plain"], num_tokens)}
    candidate = {"name": "trainer_retain", **side_figures(timings["trainer"], num_tokens)}
    return {
        "batch": [batch_size, seq_len],
        "reps": reps,
        "warmup": warmup,
        "baseline": baseline,
        "candidate": candidate,
        "ratio": candidate["tokens_per_s"] / baseline["tokens_per_s"],
        "paired_ratio": paired_ratio(timings["plain"], timings["trainer"]),
        "cpu_ratio": candidate["tokens_per_cpu_s"] / baseline["tokens_per_cpu_s"],
        "max_abs_delta_loss": max_abs_delta(timings["plain"].losses, timings["trainer"].losses),
        "losses": {"baseline": timings["plain"].losses, "candidate": timings["trainer"].losses},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.trainer_overhead", description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--long", action="store_true", help="also measure batch-size × --long-seq-len")
    parser.add_argument("--long-seq-len", type=int, default=4096)
    parser.add_argument("--long-reps", type=int, default=1, help="timed reps of the long case (the 1K case warms up)")
    args = parser.parse_args(argv)
    spec = spec_from_args(args)
    model = spec.build(seed=0).to(args.device)
    summary = model_summary(spec, model)
    print(f"model: {summary}", flush=True)
    plain_model, trainer_model = fresh_copies(model, 2)
    del model
    plain, trainer = PlainLoop(plain_model), TrainerLoop(trainer_model, "retain")

    main_case = run_case(
        plain,
        trainer,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        vocab_size=spec.vocab_size,
        warmup=args.warmup,
        reps=args.reps,
        first_batch=0,
        device=args.device,
    )
    result = {
        "bench": "trainer_overhead",
        "baseline": main_case["baseline"],
        "candidate": main_case["candidate"],
        "ratio": main_case["ratio"],
        "higher_is_better": True,
        "metric": "tokens_per_s (median step)",
        "target_ratio": TARGET_RATIO,
        "paired_ratio": main_case["paired_ratio"],
        "cpu_ratio": main_case["cpu_ratio"],
        "meets_target": main_case["ratio"] >= TARGET_RATIO,
        "batch": main_case["batch"],
        "reps": args.reps,
        "warmup": args.warmup,
        "max_abs_delta_loss": main_case["max_abs_delta_loss"],
        "losses": main_case["losses"],
        "model": summary,
        "quick": args.quick,
    }
    if args.long and not args.quick:
        # The first case already warmed kernels and allocator up; a long step costs minutes, so no extra warm-up.
        long_case = run_case(
            plain,
            trainer,
            batch_size=args.batch_size,
            seq_len=args.long_seq_len,
            vocab_size=spec.vocab_size,
            warmup=0,
            reps=args.long_reps,
            first_batch=10_000,
            device=args.device,
        )
        result["long"] = long_case
    else:
        result["long"] = None
        result["long_skipped"] = (
            f"{args.batch_size}x{args.long_seq_len} fits in memory (≈7 GiB per side) but costs ≈80 s per step per "
            "side on 2 CPU cores (attention is quadratic), past the default run's ≈3 min; pass --long to measure it"
        )
    print(
        f"ratio {result['ratio']:.3f} (target ≥ {TARGET_RATIO}; paired {result['paired_ratio']:.3f}, CPU-time "
        f"{result['cpu_ratio']:.3f}), max |Δloss| {result['max_abs_delta_loss']:.2e}",
        flush=True,
    )
    emit(result)
    return result


if __name__ == "__main__":
    main()
