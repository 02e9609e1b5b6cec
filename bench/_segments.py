"""Shared pieces of the rank benchmarks that time real segment launches: a plan, a launch, its step figures.

The plan trains a Qwen3-style model wider than the example's (so a step is
dominated by matmuls, not by Python or collectives) on the shipped SFT data,
with L = 4 logical ranks. Each launch runs `trainer_core.run.segment_main` under
torchrun (gloo) at the world size asked; its speed is the median tokens/s of
the steps after the first (the first warms kernels and the allocator), read
from the progress records rank 0 writes, so start-up never counts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from infra.launch.launcher import launch
from trainer_core.config import config_from_dict
from trainer_core.run.plan import build_plan, run_dir_for, write_plan
from trainer_core.run.progress import progress_path
from trainer_core.run.records import SegmentResult
from trainer_core.run.segment_main import segment_result_path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MODEL = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "layer_types": ["full_attention"] * 4,
}
"""The example's config (vocabulary 1024, the tokenizer's) made wider and deeper: ≈ 3.7M parameters."""


def parse_segment_args(prog: str, doc: str, launches: str, argv: list[str] | None) -> argparse.Namespace:
    """The options every segment-launching benchmark takes: rounds, steps, a quick smoke run."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help=f"rounds of the {launches}")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per launch (the first is not timed)")
    parser.add_argument("--quick", action="store_true", help="smoke run: the example's tiny model, 1 round, 3 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.steps = 1, 3
    return args


def plan_run(work_dir: Path, *, steps: int, logical_dp: int, train: dict, quick: bool = False) -> Path:
    """Write a one-segment plan under `work_dir`; returns its run directory."""
    model = json.loads((EXAMPLES / "tiny" / "model_config.json").read_text())
    if not quick:
        model.update(MODEL)
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / "model_config.json").write_text(json.dumps(model))
    tree = {
        "run": {"name": "bench", "seed": 1, "work_dir": str(work_dir / "work")},
        "model": {"config": str(work_dir / "model_config.json")},
        "tokenizer": {"path": str(EXAMPLES / "tiny" / "tokenizer.json")},
        "data": {"path": str(EXAMPLES / "tiny" / "sft.jsonl"), "max_seq_len": 128, "pack": True},
        "train": {
            "steps": steps,
            "steps_per_segment": steps,
            "global_batch_size": 16,
            "logical_dp": logical_dp,
            "learning_rate": 1e-3,
            "collective_timeout_s": 300,
            **train,
        },
        "storage": {"url": str(work_dir / "store")},
    }
    config = config_from_dict(tree, config_dir=work_dir)
    plan, shards = build_plan(config)
    run_dir = run_dir_for(config, plan.run_id)
    write_plan(plan, shards, run_dir)
    return run_dir


def run_segment(run_dir: Path, world_size: int, env: dict[str, str] | None = None) -> dict:
    """One launch of segment 0; returns its median tokens/s (steps after the first), losses and threads."""
    lines: list[str] = []
    result = launch(
        "trainer_core.run.segment_main",
        ["--run-dir", str(run_dir), "--segment", "0"],
        nproc_per_node=world_size,
        timeout_s=1200,
        on_line=lines.append,
        env=env,
    )
    if result.returncode != 0:
        raise RuntimeError("segment launch failed:\n" + "\n".join(lines[-30:]))
    records = [json.loads(line) for line in progress_path(run_dir, 0).read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    timed = steps[1:] or steps
    segment = SegmentResult.read(segment_result_path(run_dir, 0))
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "step_s": [round(r["step_s"], 4) for r in timed],
        "losses": segment.losses,
        "threads_per_process": segment.threads_per_process,
        "world_size": world_size,
    }


def machine() -> dict:
    return {"cpus": os.cpu_count(), "load_average_1m_5m_15m": [round(x, 2) for x in os.getloadavg()]}
