"""Deterministic logical ranks on a sharded Trainer: logical_dp = 4 bitwise at W = 1, 2, 4 and the unsharded run's.

One torchrun launch per world size (tests/ranks/sharded_logical_worker.py)
trains three steps through the logical-DP facade on an FSDP2-sharded model;
the third step's batch has 3 rows for 4 logical ranks (an empty logical rank:
a dummy turn sending +0). References: the other world sizes, and the
unsharded trainer's deterministic run of the same scenario (W = 1 launch,
and clipped at W = 1 and 2). Both deterministic reductions take their step's
norm from `canonical_norm`, so even clipped runs agree to the bit, norms
included.
"""

from __future__ import annotations

import pytest

from tests.ranks.sharded_logical_worker import CLIPPED
from tests.trainer.models import tiny_qwen3
from tests.trainer.sharded_ranks import launch_results
from trainer_core.parallel.fsdp.gradients import ShardedLogicalGradients
from trainer_core.ranks import Topology
from trainer_core.training import Trainer

WORLD_SIZES = [1, 2, 4]
WORKER = "tests.ranks.sharded_logical_worker"


def test_round_robin_assignment_runs_logical_rank_j_w_plus_p_and_contiguous_stays_the_default():
    assert [list(Topology(p, 2, 4, "round_robin").local_logical_ranks) for p in range(2)] == [[0, 2], [1, 3]]
    assert [Topology(0, 2, 4, "round_robin").owner_of(r) for r in range(4)] == [0, 1, 0, 1]
    assert list(Topology(1, 2, 4).local_logical_ranks) == [2, 3]  # unsharded: unchanged
    with pytest.raises(ValueError, match="assignment="):
        Topology(0, 1, 4, "strided")  # type: ignore[arg-type]


def test_the_sharded_reduction_refuses_an_unsharded_trainer():
    with pytest.raises(ValueError, match="reduces a sharded model"):
        ShardedLogicalGradients(Trainer(tiny_qwen3()), Topology(0, 1, 4, "round_robin"))


distributed = pytest.mark.distributed  # the launches; the two tests above need none


@pytest.fixture(scope="module")
def runs() -> dict[int, dict]:
    return {world_size: launch_results(WORKER, world_size) for world_size in WORLD_SIZES}


def results(runs, world_size: int, check: str) -> list[dict]:
    found = [runs[world_size].get((check, rank)) for rank in range(world_size)]
    assert all(found), (check, world_size, sorted(runs[world_size]))
    return found  # type: ignore[return-value]


def trained(result: dict) -> tuple:
    return result["losses"], result["norms"], result["state"]


@distributed
@pytest.mark.parametrize("check", ["sharded", "sharded_clipped"])
def test_losses_weights_and_moments_are_bitwise_the_same_at_every_world_size(runs, check):
    """Clipped too: the sharded deterministic norm is canonical_norm, so even the norms agree to the bit."""
    reference = trained(results(runs, 1, check)[0])
    for world_size in WORLD_SIZES:
        for result in results(runs, world_size, check):
            assert trained(result) == reference, (world_size, result["rank"])


@distributed
@pytest.mark.parametrize("check", ["sharded", "sharded_head"])
def test_without_clipping_they_are_bitwise_the_unsharded_deterministic_run(runs, check):
    """Losses, whole weights and AdamW moments; an empty logical rank at the third step included. With a value
    head (replicated: each logical rank's partial kept apart and folded in logical order at the step), the head's
    weights and moments too."""
    unsharded = results(runs, 1, check.replace("sharded", "unsharded"))[0]
    for world_size in WORLD_SIZES:
        for result in results(runs, world_size, check):
            assert result["losses"] == unsharded["losses"], world_size
            assert result["state"] == unsharded["state"], world_size


@distributed
def test_clipped_the_sharded_and_the_unsharded_deterministic_runs_are_bitwise_equal_at_one_and_two_processes(runs):
    """Clipping bites at every step (norm > grad_clip), so the step's norm reaches the weights: the sharded and
    the replicated trainer at W = 1 and 2 agree on losses, norms, whole weights and AdamW moments to the bit."""
    reference = trained(results(runs, 1, "unsharded_clipped")[0])
    assert all(float.fromhex(norm) > 2 * CLIPPED.grad_clip for norm in reference[1]), reference[1]
    for world_size in (1, 2):
        for check in ("sharded_clipped", "unsharded_clipped"):
            for result in results(runs, world_size, check):
                assert trained(result) == reference, (check, world_size, result["rank"])


@distributed
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_an_aborted_logical_rank_backward_leaves_every_shard_unchanged_and_the_retry_is_bitwise(runs, world_size):
    """The last process fails after its backward at its last logical rank of step 0 (after a committed turn when
    W < 4): every process raises, every gradient shard is as before, and the retried run ends bitwise the same."""
    clean = trained(results(runs, world_size, "sharded")[0])
    for rank, result in enumerate(results(runs, world_size, "sharded_fault")):
        fault = result["fault"]
        assert fault["raised"] == ("RuntimeError" if rank == world_size - 1 else "GradientTransactionError"), fault
        assert fault["unchanged"], fault
        assert (fault["committed_before"] > 0) == (world_size < 4), fault
        assert trained(result) == clean, rank


@distributed
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_second_backward_in_one_logical_ranks_block_is_refused_on_every_process(runs, world_size):
    """It would fold as a turn of its own (another association than the unsharded partial's): refused before
    autograd runs, on every process alike, and the block's committed gradient stays bitwise as it was."""
    for result in results(runs, world_size, "second_backward"):
        assert len(result["messages"]) == 4 // world_size, result
        for message in result["messages"]:
            assert message is not None and "a second backward inside logical rank" in message, result
        assert all(result["kept"]), result


@distributed
def test_an_empty_logical_ranks_dummy_turn_leaves_the_callers_rng_as_at_one_process(runs):
    """Dropout on, 3 rows for 4 logical ranks: the empty rank's dummy forward (W > 1 only) draws its dropout from
    a fork, so the driver's `torch.randperm` after the step is W = 1's on every process (a per-step shuffle stays in
    step), and the step itself is bitwise W = 1's."""
    reference = results(runs, 1, "empty_rank_rng")[0]
    for world_size in WORLD_SIZES:
        for result in results(runs, world_size, "empty_rank_rng"):
            assert result["perm"] == reference["perm"], (world_size, result["rank"], result["perm"], reference["perm"])
            assert (result["loss"], result["state"]) == (reference["loss"], reference["state"]), world_size


@distributed
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_replay_beside_an_empty_logical_rank_is_refused_before_any_collective(runs, world_size):
    """The dummy turn retains, a replay gathers again in backward: gloo aborted on the mismatch. Now every process
    refuses at the turn's first forward, naming the rule and the logical ranks, and the next step (retain) is in
    step and bitwise the same at every W; at W = 1 no dummy runs and replay trains."""
    reference = results(runs, 1, "replay_beside_empty")[0]
    for result in results(runs, world_size, "replay_beside_empty"):
        refused = result["refused"]
        if world_size == 1:
            assert refused is None, result
        else:
            assert refused is not None and "their forwards must gather alike" in refused, result
            assert "mode='replay'" in refused and "logical rank 3 runs mode='retain' (the dummy" in refused, result
            assert "empty_mode" in refused and "refused before any collective" in refused, result
        assert (result["loss"], result["state"]) == (reference["loss"], reference["state"]), result
