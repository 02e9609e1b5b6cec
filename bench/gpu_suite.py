"""The trainer's device checks in one prepared run: its CUDA-path tests, two-rank NCCL, and the trainer benchmarks.

    python -m bench.gpu_suite                  # on a GPU machine (≈3-5 min on one GPU before the sharded parts)
    python -m bench.gpu_suite --device cpu     # the same suite on the CPU (the cuda cases skip)
    python -m bench.gpu_suite --device cpu --quick   # a smoke run: the tests and reduced benchmarks

1. `tests/trainer/test_device_paths.py` for the device (pinned host offload,
   the CUDA RNG replayed, CUDA-event timings) and the bf16 test of
   `test_optimizer_step.py` (FP32 masters against AdamW on an FP32 copy);
2. with two GPUs, `tests/trainer/device_rank_worker.py` on 2 ranks over NCCL
   (on the CPU, over gloo; skipped with `--quick` and on one GPU);
3. the sharded trainer's tests (`tests/trainer/test_sharded_trainer.py`,
   `tests/ranks/test_sharded_*.py`: torchrun over gloo at W = 1, 2, 4), on
   the CPU with the GPUs hidden from them (`CUDA_VISIBLE_DEVICES=""`: their
   workers build gloo meshes of CPU tensors; skipped with `--quick`; 69
   tests, 4.5 min on 2 CPU cores);
4. `bench.trainer_overhead`, `bench.backward_state` and `bench.planner_choices`
   with `--device` (reduced with `--quick`), and `bench.sharding` with
   `--device`: on CUDA over NCCL at W = 2 with two GPUs, else at W = 1 on
   the one GPU (the sharded trainer's CUDA path and its bitwise losses; the
   bytes ratio means something at W = 2 only).

The last line of standard output is one JSON object: every part's outcome,
the benchmarks' headline figures, the device, the wall time and `ok`. Exit
status 0 only when every part passed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DEVICE_TESTS = [
    "tests/trainer/test_device_paths.py",
    "tests/trainer/test_optimizer_step.py::test_bf16_parameters_train_through_fp32_masters_as_adamw_on_an_fp32_copy",
]


SHARDED_TESTS = [
    "tests/trainer/test_sharded_trainer.py",
    "tests/ranks/test_sharded_fold.py",
    "tests/ranks/test_sharded_logical_ranks.py",
]


def run_sharded_tests(quick: bool) -> dict:
    """The sharded trainer's tests (torchrun over gloo), with the GPUs hidden: their workers' meshes are CPU ones."""
    if quick:
        return {"ok": True, "skipped": "--quick"}
    return run_tests("cpu", SHARDED_TESTS, env={"CUDA_VISIBLE_DEVICES": ""}, select=None)


def run_tests(
    device: str, paths: list[str] | None = None, *, env: dict[str, str] | None = None, select: str | None = ""
) -> dict:
    """pytest on the device tests (the other device's cases deselected); counts from its JUnit report.

    `paths` other tests instead, with `env` added to the environment and `select` as `-k` (None: every test)."""
    paths = paths or DEVICE_TESTS
    if select == "":
        select = "not cpu" if device == "cuda" else "not cuda"
    with tempfile.TemporaryDirectory(prefix="rankflow-gpu-suite-") as scratch:
        report = Path(scratch) / "junit.xml"
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            f"--basetemp={scratch}/tmp",
            *(["-k", select] if select is not None else []),
            *paths,
        ]
        started = time.perf_counter()
        completed = subprocess.run(
            command,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        wall_s = time.perf_counter() - started
        print(completed.stdout[-4000:], flush=True)
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        if report.is_file():
            suite = ElementTree.parse(report).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            counts = {key: int(suite.get(key, 0)) for key in counts}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {
        "ok": completed.returncode == 0 and passed > 0,
        "returncode": completed.returncode,
        "passed": passed,
        **counts,
        "wall_s": wall_s,
        "paths": paths,
    }


def run_two_ranks(device: str, quick: bool) -> dict:
    """The data-parallel worker on two ranks: NCCL on two GPUs, gloo on the CPU."""
    if quick:
        return {"ok": True, "skipped": "--quick"}
    if device == "cuda" and torch.cuda.device_count() < 2:
        return {"ok": True, "skipped": f"{torch.cuda.device_count()} GPU(s); NCCL needs 2"}
    from infra.launch.launcher import launch

    lines: list[str] = []
    started = time.perf_counter()
    result = launch(
        "tests.trainer.device_rank_worker",
        ["cuda" if device == "cuda" else "cpu"],
        nproc_per_node=2,
        timeout_s=300,
        env={"PYTHONPATH": str(ROOT)},
        on_line=lines.append,
    )
    agreed = sum("data-parallel steps equal one process" in line for line in lines)
    if result.returncode != 0:
        print("\n".join(lines[-40:]), flush=True)
    return {
        "ok": result.returncode == 0 and agreed == 2,
        "backend": "nccl" if device == "cuda" else "gloo",
        "ranks_agreeing": agreed,
        "wall_s": time.perf_counter() - started,
    }


def run_sharding_bench(device: str, quick: bool) -> dict:
    """`bench.sharding` on the device: W = 2 (NCCL needs a GPU per process: W = 1 on one GPU)."""
    from bench import sharding

    world_size = 2 if device == "cpu" else min(2, torch.cuda.device_count())
    argv = ["--device", device, "--world-size", str(world_size)] + (["--quick"] if quick else [])
    started = time.perf_counter()
    try:
        result = sharding.main(argv)
    except Exception as error:  # noqa: BLE001 - reported; the other parts still count
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    keys = ("bytes_ratio", "meets_target", "tokens_per_s_ratio", "losses_bitwise", "max_abs_loss_diff")
    return {
        "ok": result["losses_bitwise"] and (result["meets_target"] or world_size == 1),
        **{key: result[key] for key in keys},
        "ratio": result["bytes_ratio"],
        "world_size": world_size,
        "backend": result["backend"],
        "wall_s": time.perf_counter() - started,
    }


def run_benchmarks(device: str, quick: bool) -> dict:
    from bench import backward_state, planner_choices, trainer_overhead

    common = ["--device", device] + (["--quick"] if quick else [])
    figures = {}
    for name, module, keys in (
        ("trainer_overhead", trainer_overhead, ("ratio", "paired_ratio", "meets_target", "max_abs_delta_loss")),
        (
            "backward_state",
            backward_state,
            ("ratio", "saved_bytes_ratio", "offload_tokens_per_s_ratio", "offload_saved_bytes_ratio", "meets_target"),
        ),
        ("planner_choices", planner_choices, ("ratio", "peak_to_budget", "saved_bytes_ratio")),
    ):
        started = time.perf_counter()
        try:
            result = module.main(common)
        except Exception as error:  # noqa: BLE001 - one failed benchmark is reported, the others still run
            figures[name] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
            continue
        figures[name] = {"ok": True, **{key: result[key] for key in keys}, "wall_s": time.perf_counter() - started}
        if name == "planner_choices":
            figures[name]["choices"] = result["candidate"]["choices"]
            figures[name]["ok"] = result["peak_to_budget"] <= 1.0
    figures["sharding"] = run_sharding_bench(device, quick)
    return figures


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_suite", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="the tests and reduced benchmarks only")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; run with --device cpu")
    started = time.perf_counter()
    tests = run_tests(args.device)
    ranks = run_two_ranks(args.device, args.quick)
    sharded = run_sharded_tests(args.quick)
    benchmarks = run_benchmarks(args.device, args.quick)
    result = {
        "bench": "gpu_suite",
        "device": args.device,
        "device_name": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "num_gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "quick": args.quick,
        "tests": tests,
        "two_ranks": ranks,
        "sharded_tests": sharded,
        "benchmarks": benchmarks,
        "wall_s": time.perf_counter() - started,
    }
    result["ok"] = tests["ok"] and ranks["ok"] and sharded["ok"] and all(b["ok"] for b in benchmarks.values())
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
