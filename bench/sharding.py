"""Sharding (FSDP2) against replicas: what each rank holds, and what it costs.

    python -m bench.sharding [--world-size 2] [--steps 4] [--device cpu|cuda] [--dtype float32|bfloat16] [--quick]
    python -m bench.sharding --model-config 8b --dry-run [--world-size 8] [--seq-len 4096] [--device-memory-gb 80]

Measured (the default): the benchmark model (`bench._models.ModelSpec`,
about 21M parameters) at W = `--world-size` processes (default 2), one
torchrun launch (`bench/_sharding_worker.py`) in which every process trains
both sides, interleaved step by step from the same weights on the same
batches: `train.sharding = "none"` (a replica per process) and `"fsdp"`
(`training.sharding.shard_model`). Both use the deterministic reduction over
`--logical-dp` logical ranks (default 2), so their losses are bitwise equal:
the JSON says whether they are (`losses_bitwise`, also the grad norms and
the final weights) and the largest loss difference. Per side and rank it
counts the bytes of the tensors the process holds just before an optimizer
step — parameters (a DTensor's local shard), FP32 masters (bf16 replicas
only: under fsdp the FP32 shards are the masters), AdamW moments and the
reduced gradients, each storage once — next to the memory model's
prediction; `bytes_ratio` is fsdp over none for the most loaded rank (target
≤ 0.55 at W = 2). Tokens/s per side (rank 0's median step after
`--warmup`, global tokens) and their ratio: on CPU gloo the all-gathers cost
what they cost. `--device cuda` runs it over NCCL, one GPU per process (W
GPUs needed). `--quick`: a tiny model, short rows, 3 steps.

`--dry-run`: no training, nothing allocated. The memory model
(trainer_core/memory_model.py) gives the per-rank bytes of a full fine-tune
in bf16 over `--world-size` GPUs (default 8), one logical rank per GPU, one
row of `--seq-len` tokens per forward (default 4096), for `train.sharding`
none vs fsdp, each with and without block activation checkpointing, and
whether each fits `--device-memory-gb`. The model is built on the meta
device from its config: `8b` is Qwen3-8B (its config.json values below,
nothing downloaded), or give the path of a config.json.

Either way the last line is one JSON object.
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--dry-run", action="store_true", help="the memory model only: nothing is trained")
    parser.add_argument("--model-config", default="8b", help="dry run: 8b (Qwen3-8B), or the path of a config.json")
    parser.add_argument("--world-size", type=int, default=None, help="processes (default: 2 measured, 8 dry run)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (default: 512 measured, 4096 dry)")
    parser.add_argument("--device-memory-gb", type=float, default=80.0, help="dry run: the device's memory")
    parser.add_argument("--reduction", choices=("deterministic", "fast"), default="deterministic", help="dry run")
    parser.add_argument("--steps", type=int, default=4, help="measured: optimizer steps per side")
    parser.add_argument("--warmup", type=int, default=1, help="measured: untimed steps per side (of --steps)")
    parser.add_argument("--batch-size", type=int, default=4, help="measured: rows per global batch")
    parser.add_argument("--logical-dp", type=int, default=2, help="measured: logical ranks (a multiple of W)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="measured")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="measured: gloo on cpu, NCCL on cuda")
    parser.add_argument("--quick", action="store_true", help="measured: a tiny model, 64-token rows, 3 steps")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.world_size = args.world_size or 8
        args.seq_len = args.seq_len or 4096
        result = dry_run(args)
    else:
        _check_measured(parser, args)
        from bench._sharding_measured import measure

        result = measure(args)
    emit(result)
    return result


def _check_measured(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before anything is launched, settings the measured comparison cannot run."""
    if args.quick:
        args.seq_len, args.steps = min(args.seq_len or 64, 64), min(args.steps, 3)
    args.world_size = args.world_size or 2
    args.seq_len = args.seq_len or 512
    if args.steps <= args.warmup or args.steps < 2:
        parser.error(f"--steps {args.steps}: needs at least 2 and more than --warmup {args.warmup} (timed steps)")
    if args.logical_dp % args.world_size:
        parser.error(f"--logical-dp {args.logical_dp} is not a multiple of --world-size {args.world_size}")
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < args.world_size:
            parser.error(
                f"--device cuda at --world-size {args.world_size} needs {args.world_size} GPUs (NCCL: one per "
                f"process), found {torch.cuda.device_count()}; lower --world-size or run on the CPU"
            )


if __name__ == "__main__":
    main()
