"""Sharding (FSDP2) against replicas: what each rank holds, and what it costs.

    python -m bench.sharding --model-config 8b --dry-run [--world-size 8] [--seq-len 4096] [--device-memory-gb 80]

`--dry-run`: no training, nothing allocated. The memory model
(trainer_core/memory_model.py) gives the per-rank bytes of a full fine-tune
in bf16 over `--world-size` GPUs, one logical rank per GPU, one row of
`--seq-len` tokens per forward, for `train.sharding` none vs fsdp, each with
and without block activation checkpointing, and whether each fits
`--device-memory-gb`. The model is built on the meta device from its config:
`8b` is Qwen3-8B (its config.json values below, nothing downloaded), or give
the path of a config.json. The last line is one JSON object.

The measured half (the benchmark model at W = 2, fsdp vs none: parameter +
master + moment + gradient bytes per rank, tokens/s, losses bitwise equal)
drives the sharded Trainer through `train.sharding`, which the config does not
offer yet (issue 16); until then the command refuses to run without
`--dry-run` rather than report figures it did not measure.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench._models import emit
from trainer_core.memory_model import GB, LABELS, MemorySettings, predict

QWEN3_8B = {  # Qwen/Qwen3-8B config.json, the values that decide shapes
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
}
MODEL_CONFIGS = {"8b": ("Qwen3-8B", QWEN3_8B)}
SIDES = (("none", "none"), ("none", "blocks"), ("fsdp", "none"), ("fsdp", "blocks"))
"""(train.sharding, train.activation_checkpointing) per row of the table."""


def _model_config(name: str):
    from transformers import AutoConfig

    if name in MODEL_CONFIGS:
        label, values = MODEL_CONFIGS[name]
        values = dict(values)
        return label, AutoConfig.for_model(values.pop("model_type"), **values)
    path = Path(name)
    if not path.is_file():
        raise SystemExit(f"--model-config {name!r}: neither {sorted(MODEL_CONFIGS)} nor a config.json file")
    return path.name, AutoConfig.from_pretrained(str(path))


def dry_run(args: argparse.Namespace) -> dict:
    from trainer_core.memory_shape import activation_fit, meta_model, model_shape

    label, config = _model_config(args.model_config)
    shape = model_shape(meta_model(config, "bfloat16"))
    fit = activation_fit(config, "bfloat16")
    limit = args.device_memory_gb * GB
    rows = []
    for sharding, checkpointing in SIDES:
        settings = MemorySettings(
            sharding=sharding,  # type: ignore[arg-type]  # a Sharding literal
            world_size=args.world_size,
            dtype="bfloat16",
            logical_dp=args.world_size,
            reduction=args.reduction,
            activation_checkpointing=checkpointing,
            rows_per_logical_rank=1,
            seq_len=args.seq_len,
        )
        estimate = predict(shape, fit, settings)
        rows.append(
            {
                "sharding": sharding,
                "activation_checkpointing": checkpointing,
                "per_rank_gb": {name: round(value / GB, 2) for name, value in estimate.terms().items()},
                "state_gb": round(estimate.state / GB, 2),
                "total_gb": round(estimate.total / GB, 2),
                "fits": estimate.total <= limit,
            }
        )
    _print_table(label, shape.numel, args, rows)
    return {
        "bench": "sharding",
        "mode": "dry_run",
        "model": label,
        "params": shape.numel,
        "world_size": args.world_size,
        "dtype": "bfloat16",
        "reduction": args.reduction,
        "rows_per_forward": 1,
        "seq_len": args.seq_len,
        "device_memory_gb": args.device_memory_gb,
        "sides": rows,
        "fits": {f"{r['sharding']}+ac={r['activation_checkpointing']}": r["fits"] for r in rows},
    }


def _print_table(label: str, numel: int, args: argparse.Namespace, rows: list[dict]) -> None:
    print(
        f"{label} ({numel / 1e9:.3f} B params), full fine-tune, bf16, W = {args.world_size}, reduction "
        f"{args.reduction}, 1 × {args.seq_len} tokens per forward; GB per rank (1e9 bytes):"
    )
    heads = [f"{s}/ac={c}" for s, c in SIDES]
    print(f"  {'':<28}" + "".join(f"{h:>16}" for h in heads))
    for name in rows[0]["per_rank_gb"]:
        print(f"  {LABELS[name]:<28}" + "".join(f"{r['per_rank_gb'][name]:>16.2f}" for r in rows))
    print(f"  {'total':<28}" + "".join(f"{r['total_gb']:>16.2f}" for r in rows))
    fits = [("yes" if r["fits"] else "no") for r in rows]
    print(f"  {f'fits {args.device_memory_gb:g} GB':<28}" + "".join(f"{f:>16}" for f in fits), flush=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m bench.sharding", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-config", default="8b", help="8b (Qwen3-8B), or the path of a config.json")
    parser.add_argument("--dry-run", action="store_true", help="the memory model only: nothing is trained")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--device-memory-gb", type=float, default=80.0)
    parser.add_argument("--reduction", choices=("deterministic", "fast"), default="deterministic")
    args = parser.parse_args(argv)
    if not args.dry_run:
        print(
            "bench.sharding: the measured W = 2 comparison needs the sharded Trainer (train.sharding), which is not "
            "wired yet; run with --dry-run for the memory model's figures",
            file=sys.stderr,
        )
        raise SystemExit(2)
    result = dry_run(args)
    emit(result)
    return result


if __name__ == "__main__":
    main()
