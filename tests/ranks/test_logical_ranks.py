"""The same runs at W = 1 (in this process, no process group), 2 and 4 (torchrun, gloo) with L = 4: bitwise equal.

Scenarios (tests/ranks/logical_worker.py): SPMD SFT over the logical-DP facade
on even and uneven batches (logical ranks — at W = 4 whole processes — with
no rows), with and without seeing the empty shards; an SFT and an off-policy
RL loop written for one process, through the rank-zero facade; loops of both
facades that shuffle with torch's global RNG after their forwards (the facades
must leave the caller's streams as they were); the sharded fold itself; the
reduce API. Dropout is on, so the per-logical-rank seeds count.
"""

from __future__ import annotations

import json

import pytest

from infra.launch.launcher import launch
from tests.ranks.logical_worker import OVERLAPPED, fast_scenario, run_scenarios
from tests.ranks.loops import LOGICAL_DP
from tests.trainer.ranks import ROOT
from trainer_core.ranks import Topology, pin_threads

pytestmark = pytest.mark.distributed


@pytest.fixture
def one_thread():
    """The workers pin one thread per process; so does the W = 1 reference (conftest restores the count after)."""
    pin_threads(1)


def launch_worker(world_size: int, out_dir) -> dict:
    lines: list[str] = []
    result = launch(
        "tests.ranks.logical_worker",
        ["--out", str(out_dir)],
        nproc_per_node=world_size,
        timeout_s=300,
        env={"PYTHONPATH": str(ROOT)},
        on_line=lines.append,
    )
    assert result.returncode == 0, "\n".join(lines[-40:])
    assert sum(f"OK rank {r} of {world_size}" in line for line in lines for r in range(world_size)) == world_size
    return json.loads((out_dir / f"results-w{world_size}.json").read_text())


def test_every_scenario_is_bitwise_the_same_at_one_two_and_four_processes(tmp_path, one_thread):
    reference = run_scenarios(Topology(0, 1, LOGICAL_DP))
    assert set(reference) == {
        "spmd_even",
        "spmd_uneven",
        "spmd_uneven_skipping_empty",
        "rank_zero_sft",
        "rank_zero_rl",
        "spmd_shuffled",
        "rank_zero_shuffled",
        "fold",
        "reduce",
        *(name for name, _, _ in OVERLAPPED),
    }
    for world_size in (2, 4):
        results = launch_worker(world_size, tmp_path)
        for scenario, expected in reference.items():
            assert results[scenario] == expected, f"{scenario} differs at W={world_size}"
        # The overlapped fold was used where the hooks' buckets were the published gradients, and dropped where not.
        counts = results["overlap_counts"]
        steps = {name: len(rows) for name, rows, _ in OVERLAPPED}
        for name in ("overlapped_even", "overlapped_uneven", "overlapped_micro"):
            assert counts[name]["rounds_folded"] == steps[name] and counts[name]["rounds_dropped"] == 0, counts[name]
            assert counts[name]["buckets_sent_in_backward"] >= 4 * steps[name], (name, counts[name])
        for name in ("overlapped_extra_backward", "overlapped_edited_after"):
            assert counts[name] == {"rounds_folded": 0, "rounds_dropped": 3, "buckets_sent_in_backward": 0}, name
        # The failed try's round is dropped when the retry opens its own; the retry's round is folded.
        assert counts["overlapped_failed_then_retried"]["rounds_folded"] == 3
        assert counts["overlapped_failed_then_retried"]["rounds_dropped"] == 1
    # Uneven data matches W = 1 whether the caller sees the empty shards or not; the overlapped loops train the plain
    # ones' weights (their losses add in float64).
    assert reference["spmd_uneven"] == reference["spmd_uneven_skipping_empty"]
    assert reference["overlapped_even"]["digest"] == reference["spmd_even"]["digest"]
    assert reference["overlapped_uneven"]["digest"] == reference["spmd_uneven"]["digest"]


def test_the_comparison_is_sensitive_a_fast_reduction_differs_from_w1(tmp_path, one_thread):
    """Not a promise, a check on the test: the plain all-reduce's association at W = 4 does change bits."""
    reference = fast_scenario(Topology(0, 1, LOGICAL_DP))  # at W = 1 fast and deterministic add alike
    lines: list[str] = []
    result = launch(
        "tests.ranks.logical_worker",
        ["--out", str(tmp_path), "--fast"],
        nproc_per_node=4,
        timeout_s=300,
        env={"PYTHONPATH": str(ROOT)},
        on_line=lines.append,
    )
    assert result.returncode == 0, "\n".join(lines[-40:])
    fast = json.loads((tmp_path / "fast.json").read_text())
    assert fast["digest"] != reference["digest"]
