"""`python -m bench.launch`: where a segment launch's seconds go, against the floor of a bare torchrun launch.

The tiny job (`examples/tiny_sft.toml`: 2 gloo ranks, 20 steps a segment) is
planned once; segment 0 is launched once (it writes the state the others
resume from), then, interleaved, `--reps` launches of segment 1 (which loads
segment 0's state, as every segment after the first does) as a run makes them
(its ranks forked by the run's warm process, `infra.launch.warm_ranks`), as
many with every rank importing by itself (`cold`: as before warm processes),
and as many bare torchrun launches of the same number of ranks running
`bench/scripts/launch_floor.py` (import torch, join a gloo process group: the floor).
Each segment launch is split from timestamps: the bench's clock around
`infra.launch.launcher.launch`, the marks rank 0 puts in its `ready` record
(`trainer_core.run.launch_phases`) and the times of its progress records:

    launch → process start → imports done → process group → model built → state loaded → ready
           → first optimizer step → last step → state saved → launch returned

The ratio is the segment's median time to its first optimizer step over the
floor's median time to its process group (lower is better; 1.0 would be a
segment that costs nothing beyond torchrun and torch). The rank's import cost
is also broken down (`python -X importtime`), naming the heavy packages a rank
loads that it does not need.

    python -m bench.launch                              # 5 launches of each side
    python -m bench.launch --before /work/main --reps 7 # and, interleaved, another checkout's (before/after)
    python -m bench.launch --quick                      # smoke run: 1 launch of each side
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._segments import machine

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"
"""Scripts run by their path, from a folder of their own: bench/ holds a `tokenize.py`, which would shadow the
standard library's for a script run from it."""
FLOOR_SCRIPT = SCRIPTS / "launch_floor.py"
SEGMENT_LAUNCH_SCRIPT = SCRIPTS / "segment_launch.py"
TARGET_TO_FIRST_STEP_S = 4.0
"""The issue's target: a segment launch's time to its first optimizer step on the tiny job, on a quiet machine."""

INTERVALS: tuple[tuple[str, str], ...] = (
    ("process_start", "torchrun_agent_s"),
    ("imports_done", "interpreter_imports_s"),
    ("process_group", "process_group_s"),
    ("model_built", "model_build_s"),
    ("state_loaded", "state_load_s"),
    ("ready", "shard_and_ready_s"),
    ("first_step", "first_step_s"),
    ("last_step", "later_steps_s"),
    ("saved", "save_s"),
    ("exit", "exit_s"),
)
"""Each interval, named, by the mark that ends it; it starts at the mark before (the first at `launch`)."""

UNNEEDED_BY_A_RANK = ("prefect", "matplotlib", "s3fs", "fsspec", "pandas", "boto3", "aiohttp")
"""Packages a training rank has no use for: importing them only slows every launch."""


def segment_marks(launch_start: float, launch_end: float, records: list[dict]) -> dict[str, float]:
    """The epoch-second marks of one segment launch, from the bench's clock and rank 0's progress records."""
    ready = next(r for r in records if r["event"] == "ready")
    steps = [r["time"] for r in records if r["event"] == "step"]
    saved = next(r["time"] for r in records if r["event"] == "saved")
    phases = {k: v for k, v in ready.get("phases", {}).items() if k != "shard_loaded"}
    return {
        "launch": launch_start,
        **phases,
        "ready": ready["time"],
        "first_step": steps[0],
        "last_step": steps[-1],
        "saved": saved,
        "exit": launch_end,
    }


def breakdown(marks: dict[str, float]) -> dict[str, float]:
    """Seconds of each interval of `INTERVALS`; an interval whose start mark is missing merges into the next
    (its name then joins both: `torchrun_agent+interpreter_imports+…_s`), so the pieces always sum to the wall."""
    pieces: dict[str, float] = {}
    previous, pending = marks["launch"], []
    for mark, name in INTERVALS:
        pending.append(name.removesuffix("_s"))
        if mark not in marks:
            continue
        pieces["+".join(pending) + "_s"] = round(marks[mark] - previous, 3)
        previous, pending = marks[mark], []
    pieces["to_first_step_s"] = round(marks["first_step"] - marks["launch"], 3)
    pieces["wall_s"] = round(marks["exit"] - marks["launch"], 3)
    return pieces


def floor_breakdown(launch_start: float, launch_end: float, marks: dict[str, float]) -> dict[str, float]:
    """The floor launch's pieces: torchrun agent, interpreter and `import torch`, process group, exit."""
    return {
        "torchrun_agent_s": round(marks["process_start"] - launch_start, 3),
        "interpreter_imports_s": round(marks["imports_done"] - marks["process_start"], 3),
        "process_group_s": round(marks["ready"] - marks["imports_done"], 3),
        "exit_s": round(launch_end - marks["ready"], 3),
        "to_ready_s": round(marks["ready"] - launch_start, 3),
        "wall_s": round(launch_end - launch_start, 3),
    }


def medians(launches: list[dict[str, float]]) -> dict[str, float]:
    """The median of each piece over launches (the pieces every launch has)."""
    keys = [k for k in launches[0] if all(k in launch for launch in launches)]
    return {k: round(statistics.median(launch[k] for launch in launches), 3) for k in keys}


def import_costs_by_package(importtime_stderr: str, top: int = 8) -> dict[str, float]:
    """{package: seconds} its own modules took to import (their self times summed), largest first, from
    `python -X importtime` output (`import time: self [us] | cumulative | name`)."""
    costs: dict[str, float] = {}
    for line in importtime_stderr.splitlines():
        if not line.startswith("import time:") or line.count("|") != 2:
            continue
        self_us, _, name = line.removeprefix("import time:").split("|")
        if not self_us.strip().isdigit():  # the header line
            continue
        package = name.strip().split(".")[0]
        costs[package] = costs.get(package, 0.0) + int(self_us) / 1e6
    ranked = sorted(costs.items(), key=lambda item: -item[1])[:top]
    return {package: round(seconds, 3) for package, seconds in ranked}


def _rank_imports(code: Path) -> dict:
    """What importing the segment's entry point costs a rank, and which unneeded packages it loads."""
    probe = (
        "import sys, time, json; t = time.perf_counter(); import trainer_core.run.segment_main; "
        "s = time.perf_counter() - t; "
        f"print(json.dumps({{'import_s': round(s, 3), 'unneeded': sorted({{m.split('.')[0] for m in sys.modules}} "
        f"& set({list(UNNEEDED_BY_A_RANK)!r}))}}))"
    )
    env = {**os.environ, "PYTHONPATH": str(code)}
    timed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=code, check=True)
    traced = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import trainer_core.run.segment_main"],
        capture_output=True,
        text=True,
        env=env,
        cwd=code,
        check=True,
    )
    return {**json.loads(timed.stdout.splitlines()[-1]), "by_package_s": import_costs_by_package(traced.stderr)}


def _plan_tiny_job(work: Path) -> Path:
    from trainer_core.config import load_config
    from trainer_core.run.plan import build_plan, run_dir_for, write_plan

    config = load_config(
        ROOT / "examples" / "tiny_sft.toml", [f"run.work_dir={work / 'work'}", f"storage.url={work / 'store'}"]
    )
    plan, shards = build_plan(config)
    run_dir = run_dir_for(config, plan.run_id)
    write_plan(plan, shards, run_dir)
    return run_dir


def _launch_segment(code: Path, run_dir: Path, segment: int, world_size: int, warm: bool = True) -> dict[str, float]:
    """One launch of `segment` by `code`'s launcher and trainer core (`scripts/segment_launch.py`), split;
    `warm`: as a run launches, its ranks forked by the run's warm process (otherwise each imports by itself)."""
    command = [sys.executable, str(SEGMENT_LAUNCH_SCRIPT), str(run_dir), str(segment), str(world_size)]
    env = {**os.environ, "PYTHONPATH": str(code), "RANKFLOW_WARM_RANKS": "1" if warm else "0"}
    done = subprocess.run(command, cwd=code, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"the segment launch of {code} failed:\n{done.stderr[-4000:]}")
    timed = json.loads(done.stdout.splitlines()[-1])
    pieces = breakdown(segment_marks(timed["launch"], timed["exit"], timed["records"]))
    if timed.get("warm_ready_s") is not None:
        pieces["warm_ready_s"] = round(timed["warm_ready_s"], 3)  # before the clock: a run hides it
    return pieces


def _launch_floor(world_size: int, work: Path) -> dict[str, float]:
    out = work / "floor.json"
    out.unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world_size}",
        str(FLOOR_SCRIPT),
        "--out",
        str(out),
    ]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 2))}
    started = time.time()
    subprocess.run(command, check=True, env=env, capture_output=True, cwd=work)
    ended = time.time()
    return floor_breakdown(started, ended, json.loads(out.read_text()))


def _checkout(path: Path, option: str) -> Path:
    if not (path / "trainer_core" / "run" / "segment_main.py").is_file():
        print(
            f"bench.launch: {option} {path} holds no trainer_core/run/segment_main.py; pass a rankflow checkout",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return path.resolve()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.launch", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="launches of each side (interleaved)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 launch of each side")
    parser.add_argument("--code", type=Path, default=ROOT, help="the checkout whose segment launches are measured")
    parser.add_argument("--before", type=Path, help="another checkout (say, main) whose launches are interleaved")
    args = parser.parse_args(argv)
    code = _checkout(args.code, "--code")
    before = _checkout(args.before, "--before") if args.before is not None else None
    reps = 1 if args.quick else args.reps
    world_size = 2
    imports = {"code": _rank_imports(code), **({"before": _rank_imports(before)} if before else {})}
    print(f"rank imports: {imports}", flush=True)
    sides: dict[str, list[dict[str, float]]] = {
        "floor": [],
        "code": [],
        "cold": [],
        **({"before": []} if before else {}),
    }
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        work = Path(tmp)
        run_dirs = {"code": _plan_tiny_job(work / "code")}
        first = _launch_segment(code, run_dirs["code"], 0, world_size)  # writes the state segment 1 resumes
        print(f"segment 0 (first launch): {first}", flush=True)
        if before is not None:
            run_dirs["before"] = work / "before" / run_dirs["code"].relative_to(work / "code")
            shutil.copytree(run_dirs["code"], run_dirs["before"])
        checkouts = {"code": code, "before": before}
        for rep in range(reps):
            names = list(sides)
            for name in names[rep % len(names) :] + names[: rep % len(names)]:  # each side first in turn
                if name == "floor":
                    sides[name].append(_launch_floor(world_size, work))
                elif name == "cold":
                    sides[name].append(_launch_segment(code, run_dirs["code"], 1, world_size, warm=False))
                else:
                    checkout = checkouts[name]
                    assert checkout is not None
                    sides[name].append(_launch_segment(checkout, run_dirs[name], 1, world_size))
                print(f"rep {rep} {name}: {sides[name][-1]}", flush=True)
    floor, segment, cold_launches = medians(sides["floor"]), medians(sides["code"]), medians(sides["cold"])
    result = {
        "bench": "launch",
        "baseline": {"what": "bare torchrun: import torch, gloo process group", **floor},
        "candidate": {"what": f"segment launch of the tiny job (resumes a state), {code}", **segment},
        "ratio": round(segment["to_first_step_s"] / floor["to_ready_s"], 3),
        "higher_is_better": False,
        "target_to_first_step_s": TARGET_TO_FIRST_STEP_S,
        "meets_target": segment["to_first_step_s"] <= TARGET_TO_FIRST_STEP_S,
        "cold": {"what": "the same launches, every rank importing by itself (RANKFLOW_WARM_RANKS=0)", **cold_launches},
        "warm_to_first_step_speedup": round(cold_launches["to_first_step_s"] / segment["to_first_step_s"], 3),
    }
    if before is not None:
        earlier = medians(sides["before"])
        result["before"] = {"what": f"segment launch of the tiny job (resumes a state), {before}", **earlier}
        result["before_ratio"] = round(earlier["to_first_step_s"] / floor["to_ready_s"], 3)
        result["to_first_step_speedup"] = round(earlier["to_first_step_s"] / segment["to_first_step_s"], 3)
        result["wall_speedup"] = round(earlier["wall_s"] / segment["wall_s"], 3)
    result.update(
        {
            "first_launch": first,
            "rank_imports": imports,
            "reps": reps,
            "world_size": world_size,
            **machine(),
        }
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
