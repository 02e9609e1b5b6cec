"""`bench.gpu_suite` is not dead code: its reduced form runs on the CPU and reports every part.

A whole program run end to end (a nested pytest of the device tests, then four
benchmarks; 80-170 s on 2 cores): the `e2e` tier, not the unit tier. The
device tests it runs are in the unit tier themselves (tests/trainer/test_device_paths.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_suite_runs_on_the_cpu_and_prints_one_json_line(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "bench.gpu_suite", "--device", "cpu", "--quick"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert completed.returncode == 0 and result["ok"], completed.stdout[-3000:]
    assert result["bench"] == "gpu_suite" and result["device"] == "cpu"
    tests = result["tests"]
    assert tests["passed"] == 4 and tests["failures"] == tests["errors"] == 0  # the cpu case of each device test
    assert result["two_ranks"]["skipped"] == "--quick"
    assert result["sharded_tests"]["skipped"] == "--quick"
    benchmarks = result["benchmarks"]
    assert set(benchmarks) == {"trainer_overhead", "backward_state", "planner_choices", "sharding"}
    assert all(b["ok"] and b["ratio"] > 0 for b in benchmarks.values())
    assert benchmarks["planner_choices"]["peak_to_budget"] <= 1.0
    sharding = benchmarks["sharding"]
    assert sharding["world_size"] == 2 and sharding["backend"] == "gloo"
    assert sharding["losses_bitwise"] and sharding["meets_target"] and sharding["bytes_ratio"] <= 0.55
