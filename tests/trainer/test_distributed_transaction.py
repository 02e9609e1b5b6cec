"""Two gloo ranks: a failure on one rank aborts the backward on both, with no accumulator touched, and both retry."""

from __future__ import annotations

import pytest

from tests.trainer.ranks import launch_two_ranks

pytestmark = pytest.mark.distributed


def test_a_failing_rank_aborts_the_backward_on_every_rank():
    lines = launch_two_ranks("tests.trainer.rank_failure_worker")
    assert any("OK rank 0 stepped=True revision=1" in line for line in lines)
    assert any("OK rank 1 stepped=True revision=1" in line for line in lines)
