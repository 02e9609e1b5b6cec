"""The divisibility rule written once (`topology_problem`): the config, the node checks and the launch agree on it."""

from __future__ import annotations

import itertools

import pytest
from pydantic import ValidationError

from trainer_core.config import TrainSection
from trainer_core.node_topology import check_nodes
from trainer_core.ranks.topology import check_topology, topology_problem


def _frozen_rule(world_size: int, logical_dp: int, global_batch_size: int | None) -> str | None:
    """The rule as the three copies wrote it before it was one function (config, node_topology, ranks/topology)."""
    if logical_dp % world_size:
        return "logical_dp"
    if global_batch_size is not None and global_batch_size % logical_dp:
        return "global_batch_size"
    return None


@pytest.mark.parametrize("global_batch_size", [None, *range(1, 25)])
def test_the_rule_decides_as_the_copies_did(global_batch_size):
    for world_size, logical_dp in itertools.product(range(1, 7), range(1, 13)):
        problem = topology_problem(world_size, logical_dp, global_batch_size)
        assert (problem.what if problem else None) == _frozen_rule(world_size, logical_dp, global_batch_size)


def test_the_suggestion_is_a_multiple_that_holds():
    for value, divisor in itertools.product(range(1, 30), range(1, 9)):
        problem = topology_problem(divisor, value)
        if problem is not None:
            assert problem.suggestion % divisor == 0 and problem.suggestion >= divisor
            assert problem.suggestion <= max(value, divisor)


def _accepted(check) -> bool:
    try:
        check()
    except (ValueError, ValidationError):
        return False
    return True


@pytest.mark.parametrize("nnodes", [1, 2, 3])
def test_the_config_accepts_exactly_the_topologies_a_launch_accepts(nnodes):
    for nproc, logical_dp, batch in itertools.product(range(1, 5), range(1, 9), (4, 6, 12, 16)):
        by_config = _accepted(
            lambda: TrainSection(nnodes=nnodes, nproc_per_node=nproc, logical_dp=logical_dp, global_batch_size=batch)
        )
        by_launch = _accepted(lambda: check_topology(nnodes * nproc, logical_dp, batch))
        assert by_config is by_launch, (nnodes, nproc, logical_dp, batch)
        if nnodes > 1:
            by_nodes = _accepted(lambda: check_nodes(nnodes, nproc, logical_dp, None, None))
            assert by_nodes is (logical_dp % (nnodes * nproc) == 0)
