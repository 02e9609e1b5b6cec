"""`python -m bench.trl_parity`: the tiny job's wall time through `rankflow run` against TRL's SFTTrainer.

The same job on both sides: `examples/tiny_sft.toml` (a tiny Qwen3-style
model, 60 optimizer steps of 16 rows, AdamW with the config's learning rate,
warm-up, betas, eps and clipping, 2 gloo processes on CPU). TRL trains from
the same initial weights (the model rankflow builds from the config and its
seed, saved as a Hugging Face directory) on the same rows in the same order
(the plan's tokenized rows, each step's global batch in logical-rank order,
the plan's loss mask as TRL's `completion_mask`), launched as
`torchrun --standalone --nproc-per-node=2 bench/scripts/trl_sft.py`, and saves
its final model as rankflow commits its checkpoint. rankflow runs as a user
runs it: `rankflow run` in a fresh work dir and store each time (its own
temporary Prefect server, planning, 3 segment launches, export and commit).

Wall time is from starting the command to its exit; for rankflow, also how
long the command lingered after its last line. The sides alternate (first in
turn), `--reps` times each; the ratio is rankflow's median wall over TRL's
(lower is better; the issue's target is ≤ 2). `--before CHECKOUT` adds,
interleaved, `rankflow run` of another checkout (say, main).

    python -m bench.trl_parity                         # 3 runs of each side
    python -m bench.trl_parity --before /work/main     # and another checkout's rankflow, interleaved
    python -m bench.trl_parity --quick                 # smoke run: 1 run of each side

Needs TRL (`pip install -e '.[bench]'`); without it the benchmark exits 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench._segments import machine

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "tiny_sft.toml"
TRL_SCRIPT = Path(__file__).resolve().parent / "scripts" / "trl_sft.py"
TARGET_RATIO = 2.0
"""The issue's target: the tiny job's wall time through rankflow at most twice TRL's."""
PREFECT_ENV = {"DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
"""Telemetry off, as `.ci/run` has it."""


def plan_rows(shards: dict[int, dict]) -> dict[str, list[list[int]]]:
    """The plan's rows, unpadded, in training order: segment by segment, step by step, each step's global batch
    in row order (logical rank 0's rows first). `completion_mask` is the plan's loss mask (1: a target token)."""
    rows: dict[str, list[list[int]]] = {"input_ids": [], "completion_mask": []}
    for index in sorted(shards):
        shard = shards[index]
        for step in range(shard["input_ids"].shape[0]):
            for row in range(shard["input_ids"].shape[1]):
                length = int(shard["attention_mask"][step, row].sum())
                rows["input_ids"].append(shard["input_ids"][step, row, :length].tolist())
                rows["completion_mask"].append(shard["loss_mask"][step, row, :length].int().tolist())
    return rows


def run_timed(command: list[str], *, cwd: Path, env: dict[str, str]) -> dict:
    """Run `command`; its wall time, when its last standard-output line came, and its lines."""
    lines: list[str] = []
    last_line_at = [0.0]
    started = time.time()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stderr is not None
    errors: list[str] = []
    drain = threading.Thread(target=lambda: errors.extend(process.stderr or []), daemon=True)
    drain.start()
    for line in process.stdout:
        lines.append(line.rstrip("\n"))
        last_line_at[0] = time.time()
    process.wait()
    ended = time.time()
    drain.join(timeout=5)
    if process.returncode != 0:
        raise RuntimeError(f"{command[:4]} exited {process.returncode}:\n" + "".join(errors[-40:]))
    return {
        "wall_s": round(ended - started, 3),
        "after_last_line_s": round(ended - last_line_at[0], 3) if lines else None,
        "lines": lines,
    }


def _prepare(work: Path) -> tuple[Path, Path, dict]:
    """The job's plan rows and initial model (rankflow's own build) for TRL; returns (model dir, rows, train)."""
    import torch
    from transformers import PreTrainedTokenizerFast

    from trainer_core.config import load_config
    from trainer_core.model import build_model
    from trainer_core.run.plan import build_plan

    config = load_config(CONFIG, [f"run.work_dir={work / 'plan-work'}", f"storage.url={work / 'plan-store'}"])
    _, shards = build_plan(config)
    rows = work / "rows.pt"
    torch.save(plan_rows(shards), rows)
    model, true_vocab = build_model(config)
    assert true_vocab is None, "the tiny job pads no vocabulary"
    model_dir = work / "model"
    model.save_pretrained(model_dir)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(config.tokenizer.path))
    tokenizer.pad_token = tokenizer.eos_token = "<|endoftext|>"  # the plan pads with it (trainer_core/run/plan.py)
    tokenizer.save_pretrained(model_dir)
    return model_dir, rows, config.train.model_dump() | {"seed": config.run.seed, "max_len": config.data.max_seq_len}


def _trl_run(model_dir: Path, rows: Path, train: dict, work: Path, rep: int) -> dict:
    out = work / f"trl-{rep}.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={train['nproc_per_node']}",
        str(TRL_SCRIPT),
        *("--model", str(model_dir), "--rows", str(rows), "--out", str(out)),
        *("--steps", str(train["steps"]), "--learning-rate", str(train["learning_rate"])),
        *("--per-device-batch", str(train["global_batch_size"] // train["nproc_per_node"])),
        *("--warmup-steps", str(train["warmup_steps"]), "--grad-clip", str(train["grad_clip"])),
        *("--weight-decay", str(train["weight_decay"]), "--betas", *map(str, train["betas"])),
        *("--eps", str(train["eps"]), "--max-length", str(train["max_len"]), "--seed", str(train["seed"])),
    ]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 2))}
    timed = run_timed(command, cwd=work, env=env)
    figures = json.loads(out.read_text())
    return {
        "wall_s": timed["wall_s"],
        "train_s": round(figures["train_ended"] - figures["train_started"], 3),
        "steps": len(figures["losses"]),
        "first_loss": figures["losses"][0],
        "last_loss": figures["losses"][-1],
        "num_processes": figures["num_processes"],
        "distributed_type": figures["distributed_type"],
    }


def _rankflow_run(code: Path, work: Path, name: str, rep: int) -> dict:
    run_dir = work / f"{name}-{rep}"
    overrides = [f"run.work_dir={run_dir / 'work'}", f"storage.url={run_dir / 'store'}"]
    command = [sys.executable, "-m", "flows.cli", "run", str(CONFIG), *(a for o in overrides for a in ("--set", o))]
    env = {**os.environ, **PREFECT_ENV, "PYTHONPATH": str(code), "PREFECT_HOME": str(work / f"prefect-{name}")}
    timed = run_timed(command, cwd=code, env=env)
    summary = json.loads(timed["lines"][-1])
    return {
        "wall_s": timed["wall_s"],
        "after_last_line_s": timed["after_last_line_s"],
        "reported_wall_s": summary["wall_s"],
        "train_s": round(summary["train_s"], 3),
        "launch_wall_s": round(summary["launch_wall_s"], 3),
        "launch_overhead_s": summary["launch_overhead_s"],
        "orchestration_s": summary["orchestration_s"],
        "steps": summary["steps"],
        "first_loss": summary["losses"][0],
        "last_loss": summary["losses"][-1],
        "status": summary["status"],
    }


def medians(runs: list[dict]) -> dict:
    """The median of each numeric figure over runs; other figures as the first run has them."""
    merged = {}
    for key, value in runs[0].items():
        numbers = [run[key] for run in runs if isinstance(run.get(key), int | float) and not isinstance(run[key], bool)]
        merged[key] = round(statistics.median(numbers), 3) if len(numbers) == len(runs) else value
    return merged


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.trl_parity", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="runs of each side (interleaved)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 run of each side")
    parser.add_argument("--before", type=Path, help="another checkout whose `rankflow run` is interleaved too")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("trl") is None:
        print(
            "bench.trl_parity: TRL is not installed; install the bench extra: pip install -e '.[bench]'",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if args.before is not None and not (args.before / "flows" / "cli" / "__main__.py").is_file():
        print(f"bench.trl_parity: --before {args.before} holds no flows/cli; pass a rankflow checkout", file=sys.stderr)
        raise SystemExit(2)
    reps = 1 if args.quick else args.reps
    sides: dict[str, list[dict]] = {"trl": [], "rankflow": [], **({"before": []} if args.before else {})}
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        work = Path(tmp)
        model_dir, rows, train = _prepare(work)
        for rep in range(reps):
            names = list(sides)
            for name in names[rep % len(names) :] + names[: rep % len(names)]:  # each side first in turn
                if name == "trl":
                    sides[name].append(_trl_run(model_dir, rows, train, work, rep))
                else:
                    code = ROOT if name == "rankflow" else args.before.resolve()
                    sides[name].append(_rankflow_run(code, work, name, rep))
                print(f"rep {rep} {name}: {sides[name][-1]}", flush=True)
    trl, rankflow = medians(sides["trl"]), medians(sides["rankflow"])
    result = {
        "bench": "trl_parity",
        "baseline": {"what": "TRL SFTTrainer under torchrun", **trl},
        "candidate": {"what": f"rankflow run, {ROOT}", **rankflow},
        "ratio": round(rankflow["wall_s"] / trl["wall_s"], 3),
        "higher_is_better": False,
        "target_ratio": TARGET_RATIO,
        "meets_target": rankflow["wall_s"] / trl["wall_s"] <= TARGET_RATIO,
    }
    if args.before is not None:
        before = medians(sides["before"])
        result["before"] = {"what": f"rankflow run, {args.before.resolve()}", **before}
        result["before_ratio"] = round(before["wall_s"] / trl["wall_s"], 3)
    result.update(
        {
            "reps": reps,
            **machine(),
        }
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
