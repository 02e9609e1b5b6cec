"""The trainer's device checks in one prepared run: its CUDA-path tests, two-rank NCCL, and the trainer benchmarks.

    python -m bench.gpu_suite                  # on a GPU machine (≈3-5 min on one GPU; under 8)
    python -m bench.gpu_suite --device cpu     # the same suite on the CPU (the cuda cases skip)
    python -m bench.gpu_suite --device cpu --quick   # a smoke run: the tests and reduced benchmarks

1. `tests/trainer/test_device_paths.py` for the device (pinned host offload,
   the CUDA RNG replayed, CUDA-event timings) and the bf16 test of
   `test_optimizer_step.py` (FP32 masters against AdamW on an FP32 copy);
2. with two GPUs, `tests/trainer/device_rank_worker.py` on 2 ranks over NCCL
   (on the CPU, over gloo; skipped with `--quick` and on one GPU);
3. `bench.trainer_overhead`, `bench.backward_state` and `bench.planner_choices`
   with `--device` (reduced with `--quick`).

The last line of standard output is one JSON object: every part's outcome,
the benchmarks' headline figures, the device, the wall time and `ok`. Exit
status 0 only when every part passed.
"""

from __future__ import annotations

import argparse
import json
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


def run_tests(device: str) -> dict:
    """pytest on the device tests (the other device's cases deselected); counts from its JUnit report."""
    paths = DEVICE_TESTS
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
            "-k",
            "not cpu" if device == "cuda" else "not cuda",
            *paths,
        ]
        started = time.perf_counter()
        completed = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
        "benchmarks": benchmarks,
        "wall_s": time.perf_counter() - started,
    }
    result["ok"] = tests["ok"] and ranks["ok"] and all(b["ok"] for b in benchmarks.values())
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
