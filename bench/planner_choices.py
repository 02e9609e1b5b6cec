"""The memory planner's choices on a mixed-length workload at a fraction (default 50%) of the all-retained bytes.

Two trainers train copies of one model from identical weights on the same
micro-batches, stepping in turn. Per optimizer step, `--per-step`
micro-batches of mixed shapes (batch × row length, each row right-padded to a
random length) are all forwarded before one backward over their summed loss,
as an RL loop gathers its rollouts' logprobs first. Baseline: every graph
retained (no budget); its peak resident bytes P set the candidate's budget,
`--budget-fraction` × P, and the candidate lets the planner choose per graph.

It prints every graph's choice with the predicted and observed peak, then
the choice counts, the candidate's peak over its budget (must be ≤ 1), the
planner's misses, and tokens/s against the baseline; the last line is JSON.

    python -m bench.planner_choices            # the bench model, 1 + 4 steps of 4 micro-batches (≈2 min on 2 CPU cores)
    python -m bench.planner_choices --quick    # smoke test
"""

from __future__ import annotations

import argparse
import time

import torch

from bench._models import (
    LEARNING_RATE,
    add_model_args,
    emit,
    fresh_copies,
    median,
    model_summary,
    spec_from_args,
    synchronize,
)

SHAPES = [(2, 512), (4, 128), (1, 1024), (3, 256), (2, 384), (1, 768), (4, 192), (2, 640)]
"""Micro-batch shapes (rows, row length) cycled through the workload: short and long, few and many rows."""


def micro_batches(step: int, per_step: int, vocab_size: int, scale: float, device: str):
    """The step's micro-batches: mixed shapes, each row right-padded after a random length (at least a quarter)."""
    generator = torch.Generator().manual_seed(7000 + step)
    batches = []
    for index in range(per_step):
        rows, length = SHAPES[(step * per_step + index) % len(SHAPES)]
        length = max(8, int(length * scale))
        input_ids = torch.randint(0, vocab_size, (rows, length), generator=generator)
        kept = torch.randint(max(2, length // 4), length + 1, (rows, 1), generator=generator)
        attention_mask = (torch.arange(length)[None, :] < kept).long()
        batches.append((input_ids.to(device), attention_mask.to(device)))
    return batches


def train_step(trainer, batches) -> tuple[float, int]:
    """Forward every micro-batch, then one backward and one step; returns the loss and the padded tokens."""
    outs = [trainer.forward(ids, mask, outputs=("logprobs",)) for ids, mask in batches]
    loss = sum(-(out.logprobs * mask[:, 1:]).sum() / mask[:, 1:].sum() for out, (_, mask) in zip(outs, batches))
    trainer.backward(loss / len(batches))
    del outs
    trainer.step()
    return loss.item() / len(batches), sum(ids.numel() for ids, _ in batches)


def build(model, budget: int | None):
    from trainer_core.training import MemoryPlanner, OptimizerConfig, Trainer

    trainer = Trainer(model, planner=MemoryPlanner(budget_bytes=budget))
    trainer.add_base_checkpoint(optimizer=OptimizerConfig(learning_rate=LEARNING_RATE))
    return trainer


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.planner_choices", description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--per-step", type=int, default=4, help="micro-batches forwarded before each backward")
    parser.add_argument(
        "--budget-fraction", type=float, default=0.5, help="budget as a fraction of the all-retained peak"
    )
    parser.set_defaults(reps=4)
    args = parser.parse_args(argv)
    spec = spec_from_args(args)
    scale = 0.125 if args.quick else 1.0
    model = spec.build(seed=0).to(args.device)
    summary = model_summary(spec, model)
    print(f"model: {summary}", flush=True)
    baseline_model, candidate_model = fresh_copies(model, 2)
    del model

    # The all-retained peak, measured on the workload's own forwards (saved bytes do not depend on the weights).
    baseline = build(baseline_model, None)
    all_retained_peak = 0
    for step in range(args.warmup + args.reps):
        outs = [
            baseline.forward(ids, mask, mode="retain")
            for ids, mask in micro_batches(step, args.per_step, spec.vocab_size, scale, args.device)
        ]
        all_retained_peak = max(all_retained_peak, baseline.resident_bytes())
        del outs
    budget = int(args.budget_fraction * all_retained_peak)
    candidate = build(candidate_model, budget)
    print(
        f"all-retained peak {all_retained_peak} bytes; budget {budget} bytes ({args.budget_fraction:.0%})", flush=True
    )

    seconds: dict[str, list[float]] = {"baseline": [], "candidate": []}
    losses: dict[str, list[float]] = {"baseline": [], "candidate": []}
    tokens = 0
    for step in range(args.warmup + args.reps):
        batches = micro_batches(step, args.per_step, spec.vocab_size, scale, args.device)
        timed = step >= args.warmup  # warm-up steps count for the planner, not for the clock
        for name, trainer in (("baseline", baseline), ("candidate", candidate)):
            synchronize(args.device)
            started = time.perf_counter()
            loss, tokens = train_step(trainer, batches)
            synchronize(args.device)
            if timed:
                seconds[name].append(time.perf_counter() - started)
            losses[name].append(loss)
        print(
            f"step {step}{'' if timed else ' (warm-up)'}: loss {losses['baseline'][-1]:.5f} / "
            f"{losses['candidate'][-1]:.5f}"
            + (
                f", baseline {seconds['baseline'][-1]:.2f} s, candidate {seconds['candidate'][-1]:.2f} s"
                if timed
                else ""
            ),
            flush=True,
        )
    planner = candidate.planner
    for entry in planner.history:
        print(
            f"  [{entry['batch_size']}x{entry['seq_len']}] {entry['choice']:<7} predicted peak "
            f"{entry['predicted_peak_bytes']:.0f}, observed {entry['observed_peak_bytes']}"
            f"{'  MISS' if entry['miss'] else ''} — {entry['reason']}",
            flush=True,
        )
    baseline_tokens_per_s = tokens / median(seconds["baseline"])
    candidate_tokens_per_s = tokens / median(seconds["candidate"])
    result = {
        "bench": "planner_choices",
        "baseline": {
            "name": "all_retained",
            "peak_saved_bytes": baseline.peak_saved_bytes,
            "tokens_per_s": baseline_tokens_per_s,
            "step_s": seconds["baseline"],
        },
        "candidate": {
            "name": "planner",
            "budget_bytes": budget,
            "peak_saved_bytes": candidate.peak_saved_bytes,
            "tokens_per_s": candidate_tokens_per_s,
            "step_s": seconds["candidate"],
            "choices": dict(planner.choices),
            "num_misses": planner.num_misses,
            "forward_s_per_token": planner.forward_s_per_token,
            "pack_s_per_byte": planner.pack_s_per_byte,
            "restore_s_per_byte": planner.restore_s_per_byte,
        },
        "ratio": candidate_tokens_per_s / baseline_tokens_per_s,
        "higher_is_better": True,
        "metric": "tokens_per_s (median step)",
        "peak_to_budget": candidate.peak_saved_bytes / budget,
        "saved_bytes_ratio": candidate.peak_saved_bytes / baseline.peak_saved_bytes,
        "max_predicted_peak_bytes": max(e["predicted_peak_bytes"] for e in planner.history),
        "max_observed_peak_bytes": max(e["observed_peak_bytes"] for e in planner.history),
        "graphs": list(planner.history),
        "max_abs_delta_loss": max(abs(a - b) for a, b in zip(losses["baseline"], losses["candidate"])),
        "budget_fraction": args.budget_fraction,
        "per_step": args.per_step,
        "steps": args.reps,
        "warmup": args.warmup,
        "model": summary,
        "offload_target": candidate.offload_target,
        "quick": args.quick,
    }
    print(
        f"choices {dict(planner.choices)}; peak/budget {result['peak_to_budget']:.3f}; misses {planner.num_misses}; "
        f"tokens/s vs all-retained {result['ratio']:.3f}",
        flush=True,
    )
    emit(result)
    return result


if __name__ == "__main__":
    main()
