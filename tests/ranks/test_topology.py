"""The topology: who runs which logical rank, how a batch splits, and bad topologies refused before any process group."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from infra.launch.failures import FailureClass, diagnose_launch
from infra.launch.launcher import launch
from tasks.plan import plan_run_fn
from tests.conftest import tiny_tree
from trainer_core.config import ConfigError, config_from_dict
from trainer_core.ranks import Topology, check_topology, logical_row_ranges, step_seed
from trainer_core.run.distributed import init_distributed


def test_each_process_runs_a_contiguous_block_of_logical_ranks_in_order():
    owned = {rank: list(Topology(rank, 2, 6).local_logical_ranks) for rank in range(2)}
    assert owned == {0: [0, 1, 2], 1: [3, 4, 5]}
    assert [Topology(0, 2, 6).owner_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert list(Topology(0, 1, 4).local_logical_ranks) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "num_rows, sizes", [(8, [2, 2, 2, 2]), (6, [2, 2, 1, 1]), (3, [1, 1, 1, 0]), (0, [0, 0, 0, 0])]
)
def test_rows_split_contiguously_the_first_logical_ranks_taking_the_remainder(num_rows, sizes):
    ranges = logical_row_ranges(num_rows, 4)
    assert [len(r) for r in ranges] == sizes
    assert [i for r in ranges for i in r] == list(range(num_rows))  # every row once, in order


def test_the_split_and_the_seeds_depend_on_the_logical_rank_only():
    for world_size in (1, 2, 4):
        topology = Topology(0, world_size, 4)
        assert topology.logical_row_ranges(6) == logical_row_ranges(6, 4)
    assert step_seed(7, 3, 2) == step_seed(7, 3, 2) != step_seed(7, 3, 1)


@pytest.mark.parametrize(
    "world_size, logical_dp, batch, fix",
    [
        (3, 4, None, "launch a number of processes that divides train.logical_dp (one of [1, 2, 4])"),
        (8, 4, None, "not a multiple of world_size=8"),
        (2, 4, 10, "global_batch_size=10 is not a multiple of logical_dp=4"),
        (0, 4, None, "must both be at least 1"),
    ],
)
def test_a_bad_topology_names_the_fix(world_size, logical_dp, batch, fix):
    with pytest.raises(ValueError) as raised:
        check_topology(world_size, logical_dp, batch)
    assert fix in str(raised.value)


def test_a_bad_topology_fails_before_any_process_group_is_created(monkeypatch):
    created = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: created.append(a))
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="logical_dp=4 is not a multiple of world_size=3"):
        init_distributed(logical_dp=4, timeout_s=5)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="global_batch_size=6 is not a multiple of logical_dp=4"):
        init_distributed(logical_dp=4, timeout_s=5, global_batch_size=6)
    assert created == [] and not dist.is_initialized()


def test_the_config_refuses_a_bad_topology_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match="train.logical_dp=4 is not a multiple of train.nproc_per_node=3"):
        config_from_dict(tiny_tree(tmp_path, train={"logical_dp": 4, "nproc_per_node": 3}), config_dir=tmp_path)


@pytest.mark.distributed
def test_a_launch_at_a_world_size_that_does_not_divide_logical_dp_fails_on_every_rank_at_once(tmp_path):
    config = config_from_dict(
        tiny_tree(
            tmp_path,
            train={
                "logical_dp": 4,
                "nproc_per_node": 4,
                "steps": 1,
                "steps_per_segment": 1,
                "collective_timeout_s": 300,
            },
        ),
        config_dir=tmp_path,
    )
    planned = plan_run_fn(config)
    lines: list[str] = []
    result = launch(
        "trainer_core.run.segment_main",
        ["--run-dir", planned.run_dir, "--segment", "0"],
        nproc_per_node=3,
        timeout_s=120,
        on_line=lines.append,
    )
    # Ended by the refusal, not by the launch's timeout: no rank waited on a collective (see check_topology below).
    assert result.returncode != 0 and not result.timed_out
    refusals = [line for line in lines if "ERROR ValueError: logical_dp=4 is not a multiple of world_size=3" in line]
    # Each rank refuses on its own, before any collective; torchrun stops the others at the first refusal, so on a
    # loaded machine a rank may be stopped before it got there (it then printed nothing).
    refused = {line.split("]")[0] for line in refusals}
    assert refused and refused <= {"[rank 0", "[rank 1", "[rank 2"}, "\n".join(lines[-30:])
    assert any("in check_topology" in line for line in lines)  # refused there, before init_process_group
    failure = diagnose_launch(result, "segment")
    assert failure.cause is FailureClass.BAD_INPUT and not failure.retriable
