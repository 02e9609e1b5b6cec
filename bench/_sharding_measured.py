"""The measured half of `python -m bench.sharding`: one launch of both sides, and the report (see bench.sharding).

`measure` launches `bench._sharding_worker` on W processes, then reduces its
figures: per side the most loaded rank's bytes per term, next to the memory
model's prediction for the same model and settings, the median step time and
tokens/s; across sides the bytes ratio (fsdp / none) and whether the losses,
grad norms and final weights are bitwise equal.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

from bench._models import ModelSpec
from bench._segments import machine
from bench._worker_launch import worker_figures

TARGET_RATIO = 0.55
"""fsdp's parameter + master + moment + gradient bytes per rank over a replica's, at W = 2 (issue 16)."""
QUICK_SPEC = ModelSpec(hidden_size=128, num_layers=2, intermediate_size=384, vocab_size=1024)
TERMS = ("parameters", "masters", "moments", "gradients")


def _predicted_state(spec: ModelSpec, sharding: str, args: argparse.Namespace, world_size: int) -> int:
    """The memory model's parameters + masters + moments + gradients for this model and side."""
    from trainer_core.memory_model import MemorySettings, predict
    from trainer_core.memory_shape import activation_fit, meta_model, model_shape

    config = spec.build(seed=0).config  # the benchmark model's config (a small model: built, then dropped)
    settings = MemorySettings(
        sharding=sharding,  # type: ignore[arg-type]  # a Sharding literal
        world_size=world_size,
        dtype=args.dtype,
        logical_dp=args.logical_dp,
        reduction="deterministic",
        seq_len=args.seq_len,
    )
    estimate = predict(model_shape(meta_model(config, "float32")), activation_fit(config, args.dtype), settings)
    return estimate.state


def _side(name: str, figures: dict, num_tokens: int, predicted: int) -> dict:
    per_rank = figures["held"]
    totals = [sum(rank[t] for t in TERMS) for rank in per_rank]
    step_s = statistics.median(figures["step_s"])
    return {
        "name": f'sharding="{name}"',
        "state_bytes_per_rank": max(totals),
        "bytes": {t: max(rank[t] for rank in per_rank) for t in TERMS},
        "state_bytes_each_rank": totals,
        "predicted_state_bytes": predicted,
        "tokens_per_s": num_tokens / step_s,
        "step_s_median": step_s,
        "step_s": figures["step_s"],
        "losses": [float.fromhex(x) for x in figures["losses"]],
        "grad_norms": [float.fromhex(x) for x in figures["norms"]],
    }


def measure(args: argparse.Namespace) -> dict:
    spec = QUICK_SPEC if args.quick else ModelSpec()
    world_size = args.world_size or 2
    worker_args = [
        "--spec",
        json.dumps(dataclasses.asdict(spec)),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        "--logical-dp",
        str(args.logical_dp),
        "--dtype",
        args.dtype,
        "--device",
        args.device,
    ]
    figures = worker_figures("bench._sharding_worker", worker_args, world_size=world_size)
    num_tokens = args.batch_size * args.seq_len
    none, fsdp = (
        _side(name, figures[name], num_tokens, _predicted_state(spec, name, args, world_size))
        for name in ("none", "fsdp")
    )
    losses_bitwise = figures["none"]["losses"] == figures["fsdp"]["losses"]
    ratio = fsdp["state_bytes_per_rank"] / none["state_bytes_per_rank"]
    report = {
        "bench": "sharding",
        "mode": "measured",
        "metric": "parameter + master + moment + gradient bytes per rank (most loaded rank), fsdp / none",
        "baseline": none,
        "candidate": fsdp,
        "bytes_ratio": ratio,
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio <= TARGET_RATIO,
        "tokens_per_s_ratio": fsdp["tokens_per_s"] / none["tokens_per_s"],
        "losses_bitwise": losses_bitwise,
        "max_abs_loss_diff": max(abs(a - b) for a, b in zip(none["losses"], fsdp["losses"], strict=True)),
        "grad_norms_bitwise": figures["none"]["norms"] == figures["fsdp"]["norms"],
        "weights_bitwise": figures["none"]["weights_digest"] == figures["fsdp"]["weights_digest"],
        "world_size": figures["world_size"],
        "logical_dp": args.logical_dp,
        "reduction": "deterministic",
        "dtype": args.dtype,
        "device": args.device,
        "backend": "nccl" if args.device == "cuda" else "gloo",
        "num_params": figures["num_params"],
        "model": dataclasses.asdict(spec),
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "warmup": args.warmup,
        "quick": args.quick,
        "machine": machine(),
    }
    mb = 1e6
    print(
        f"W = {report['world_size']}, {args.dtype}, {report['backend']}: per rank fsdp holds "
        f"{fsdp['state_bytes_per_rank'] / mb:.1f} MB vs none {none['state_bytes_per_rank'] / mb:.1f} MB "
        f"(ratio {ratio:.3f}, target <= {TARGET_RATIO}); tokens/s fsdp {fsdp['tokens_per_s']:.0f} vs none "
        f"{none['tokens_per_s']:.0f} (ratio {report['tokens_per_s_ratio']:.2f}); losses bitwise equal: "
        f"{losses_bitwise} (max diff {report['max_abs_loss_diff']:.3g})",
        flush=True,
    )
    return report
