"""Folds over logical ranks, the reduce API and thread pinning, in one process (the W > 1 runs: test_logical_ranks)."""

from __future__ import annotations

import os

import pytest
import torch

from trainer_core.ranks import Topology, ordered_fold, pin_threads, reduce_over_logical_ranks, threads_for


def test_the_fold_is_left_to_right_and_another_association_gives_other_bits():
    values = torch.tensor([[1e8], [1.0], [-1e8], [1.0]], dtype=torch.float32)  # float32: 1e8 + 1 rounds to 1e8
    assert ordered_fold(values).item() == 1.0  # ((1e8 + 1) - 1e8) + 1
    paired = (values[0] + values[1]) + (values[2] + values[3])  # the association of a 2-process all-reduce
    assert paired.item() == 0.0


def test_the_fold_matches_a_sequential_python_sum_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    partials = torch.randn(5, 333, generator=generator) * torch.tensor([1e-3, 1e3, 1.0, 1e2, 1e-1])[:, None]
    expected = partials[0].clone()
    for row in partials[1:]:
        expected = expected + row
    assert torch.equal(ordered_fold(partials), expected)


def test_reduce_counts_each_logical_rank_once_in_logical_order():
    topology = Topology(0, 1, 4)
    values = {3: torch.tensor(1.0), 0: torch.tensor(1e8), 1: torch.tensor(-1e8)}  # logical rank 2: no data
    assert reduce_over_logical_ranks(values, "sum", topology).item() == 1.0  # (1e8 - 1e8) + 1, never 1e8 + 1 - 1e8
    assert reduce_over_logical_ranks([torch.tensor(2.0)] * 4, "mean", topology).item() == 2.0
    assert reduce_over_logical_ranks([torch.tensor(4.0), None, None, None], "mean", topology).item() == 1.0


@pytest.mark.parametrize(
    "values, message",
    [
        ({5: torch.tensor(1.0)}, "not run by this process"),
        ([torch.tensor(1.0)], "got 1 values for this process's 4 logical ranks"),
        ({}, "no logical rank contributed a value"),
        ({0: torch.zeros(2), 1: torch.zeros(3)}, "different shapes"),
    ],
)
def test_reduce_refuses_what_it_cannot_sum(values, message):
    with pytest.raises(ValueError, match=message):
        reduce_over_logical_ranks(values, "sum", Topology(0, 1, 4))
    with pytest.raises(ValueError, match="choose 'sum' or 'mean'"):
        reduce_over_logical_ranks([torch.tensor(1.0)] * 4, "max", Topology(0, 1, 4))


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores to run two threads")
def test_the_thread_count_changes_the_bits_of_a_reduction_so_it_is_pinned():  # conftest restores the threads
    # Why W must not choose the thread count: each thread sums its part, then the parts are added.
    values = torch.randn(4_000_000, generator=torch.Generator().manual_seed(0))
    sums = {}
    for threads in (1, 2):
        assert pin_threads(threads) == threads and os.environ["OMP_NUM_THREADS"] == str(threads)
        sums[threads] = values.sum().item()
    assert sums[1] != sums[2]


def test_deterministic_runs_pin_one_thread_unless_told_and_fast_keeps_the_launchers():
    assert threads_for("deterministic", None) == 1
    assert threads_for("deterministic", 3) == 3
    assert threads_for("fast", None) is None and threads_for("fast", 2) == 2
