"""A segment on 2 nodes × 1 process vs 1 node × 2 processes, same L: speed, and the result bitwise the same.

    python -m bench.node_scaling [--reps 3] [--steps 6] [--quick]

Both sides run segment 0 of one plan (deterministic reduction, L = 2) on this
machine, interleaved round by round: the baseline as one torchrun of 2
processes, the candidate as two torchruns of 1 process each (the local node
launches of `tasks.nodes`, c10d rendezvous on 127.0.0.1), so the candidate
pays a second agent and a rendezvous across agents. Speed is the median
tokens/s of the steps after the first (start-up never counts); the launch's
wall time is reported too. Losses and the saved state's bytes must be equal,
or the benchmark fails.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench._models import emit
from bench._segments import machine, parse_segment_args, plan_run
from infra.launch.launcher import launch
from tasks.nodes import launch_nodes
from tasks.outcomes import PlannedRun
from trainer_core.config import StorageSection, TrainSection
from trainer_core.run.progress import progress_path
from trainer_core.run.records import SegmentResult
from trainer_core.run.segment_main import segment_result_path
from trainer_core.run.state import state_dir_for

SIDES = ("1 node x 2 processes", "2 nodes x 1 process")


def _state_sha256(run_dir: Path) -> str:
    """The saved state's bytes, less each checkpoint's identity (a fresh random name per process, by design)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in state_dir_for(run_dir, 0).rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(run_dir)).encode())
        if path.name == "version.json":
            version = json.loads(path.read_text())
            version.pop("identity")
            digest.update(json.dumps(version, sort_keys=True).encode())
        else:
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _run(run_dir: Path, side: str) -> dict:
    lines: list[str] = []
    started = time.perf_counter()
    if side == SIDES[0]:
        result = launch(
            "trainer_core.run.segment_main",
            ["--run-dir", str(run_dir), "--segment", "0"],
            nproc_per_node=2,
            timeout_s=1200,
            on_line=lines.append,
        )
        if result.returncode != 0:
            raise RuntimeError("segment launch failed:\n" + "\n".join(lines[-30:]))
    else:
        plan = json.loads((run_dir / "plan.json").read_text())
        train = TrainSection(
            nnodes=2, nproc_per_node=1, logical_dp=plan["config"]["train"]["logical_dp"], segment_timeout_s=1200
        )
        planned = PlannedRun(
            run_id=plan["run_id"],
            digest=plan["digest"],
            run_dir=str(run_dir),
            segment_steps=[(0, plan["config"]["train"]["steps"])],
            train=train,
            storage=StorageSection(url=str(run_dir / "store")),
        )
        launch_nodes(planned, 0, lines.append)
    wall_s = time.perf_counter() - started
    records = [json.loads(line) for line in progress_path(run_dir, 0).read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    segment = SegmentResult.read(segment_result_path(run_dir, 0))
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in (steps[1:] or steps)),
        "launch_wall_s": wall_s,
        "losses": segment.losses,
        "state_sha256": _state_sha256(run_dir),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_segment_args("python -m bench.node_scaling", __doc__, "two launches", argv)
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="bench-node-scaling-") as tmp:
        run_dir = plan_run(
            Path(tmp),
            steps=args.steps,
            logical_dp=2,
            quick=args.quick,
            train={"reduction": "deterministic", "global_batch_size": 16},
        )
        for round_index in range(args.reps):
            for side in SIDES:
                figures = _run(run_dir, side)
                runs[side].append(figures)
                print(
                    f"round {round_index + 1}/{args.reps} {side}: {figures['tokens_per_s']:.0f} tokens/s, "
                    f"launch {figures['launch_wall_s']:.1f} s",
                    flush=True,
                )

    def summary(side: str) -> dict:
        launches = runs[side]
        return {
            "name": side,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in launches),
            "launch_wall_s": statistics.median(r["launch_wall_s"] for r in launches),
            "losses": launches[0]["losses"],
            "state_sha256": launches[0]["state_sha256"],
        }

    baseline, candidate = summary(SIDES[0]), summary(SIDES[1])
    every = [(r["losses"], r["state_sha256"]) for side in SIDES for r in runs[side]]
    if len(set(json.dumps(item) for item in every)) != 1:
        raise AssertionError(
            f"the losses or the saved state differ between node layouts: the guarantee is broken: {every}"
        )
    result = {
        "bench": "node_scaling",
        "metric": "tokens_per_s (median over rounds of each launch's median step)",
        "baseline": baseline,
        "candidate": candidate,
        "ratio": candidate["tokens_per_s"] / baseline["tokens_per_s"],
        "higher_is_better": True,
        "launch_wall_ratio": candidate["launch_wall_s"] / baseline["launch_wall_s"],
        "bitwise_equal": True,
        "logical_dp": 2,
        "reps": args.reps,
        "steps": args.steps,
        "quick": args.quick,
        "machine": machine(),
    }
    print(
        f"2 nodes x 1 / 1 node x 2: {result['ratio']:.2f}x tokens/s, launch wall {result['launch_wall_ratio']:.2f}x; "
        "losses and state bitwise equal",
        flush=True,
    )
    emit(result)
    return result


if __name__ == "__main__":
    main()
