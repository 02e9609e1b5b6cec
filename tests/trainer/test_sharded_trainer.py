"""`Trainer(model, parallelism=FullyShard(...))`: step, transactions, modes and stale graphs on shards, W = 1 and 2.

One launch per world size runs every check (tests/trainer/sharded_trainer_worker.py).
The reference is the unsharded recipe by hand on every rank: plain autograd
through the trainer's own output function on a full copy, every rank's
gradient summed in FP32 in rank order, `clip_grad_norm_` and
`torch.optim.AdamW` on full FP32 tensors (the masters, cast to bf16 for the
forward, in the bf16 recipe).
"""

from __future__ import annotations

import pytest

from tests.trainer.sharded_ranks import each_rank, launch_results

pytestmark = pytest.mark.distributed

WORLD_SIZES = [1, 2]
WORKER = "tests.trainer.sharded_trainer_worker"


@pytest.fixture(scope="module")
def runs() -> dict[int, dict]:
    return {world_size: launch_results(WORKER, world_size) for world_size in WORLD_SIZES}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_steps_are_bitwise_the_unsharded_recipe(runs, world_size, dtype):
    """Gradients (FSDP's reduce-scatter SUM), weights and AdamW moments after two steps, one of two backwards;
    the FP32 sharded parameters are the masters (no second copy), under bf16 compute too."""
    for result in each_rank(runs, world_size, f"steps_{dtype}"):
        assert result["grads"] == [True, True], result
        assert result["weights"] == [True, True], result
        assert result["moments"] and result["no_masters"], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_clipping_uses_the_global_norm_over_all_shards(runs, world_size, dtype):
    """Always clipping: the global norm is the unsharded one to float rounding (summed from per-shard partial
    norms at W > 1, so its last bit may differ: plan fact 8), and bitwise at W = 1."""
    for result in each_rank(runs, world_size, f"steps_{dtype}_clipped"):
        assert result["grads"] == [True, True], result
        assert result["norm_rel_diff"] < 1e-6, result
        assert result["max_diff"] < 1e-6, result
        if world_size == 1:
            assert result["weights"] == [True, True] and result["moments"], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_fault_after_backward_leaves_every_shard_bitwise_unchanged(runs, world_size):
    results = each_rank(runs, world_size, "fault_after_backward")
    for rank, result in enumerate(results):
        assert result["unchanged"], result
        assert result["raised"] == ("RuntimeError" if rank == world_size - 1 else "GradientTransactionError"), result
        assert result["retry_bitwise"], result  # the kept graph backpropagated again: both batches, summed


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_nan_in_one_ranks_shard_skips_the_step_on_every_rank(runs, world_size):
    for result in each_rank(runs, world_size, "nonfinite_skip"):
        assert result["stepped"] is False and "non-finite gradient norm" in result["reason"], result
        assert result["unchanged"] and result["grads_cleared"], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_nan_in_one_ranks_data_skips_the_step_on_every_rank(runs, world_size):
    for result in each_rank(runs, world_size, "nonfinite_data"):
        assert result["stepped"] is False and "non-finite gradient norm" in result["reason"], result
        assert result["unchanged"], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_what_does_not_work_sharded_yet_is_refused(runs, world_size):
    for result in each_rank(runs, world_size, "refusals"):
        reduction, lora, detach = result["messages"]
        assert reduction is not None and "logical ranks (train.reduction = 'deterministic')" in reduction
        assert lora is not None and "cannot add LoRA adapter 'a' to a sharded model" in lora
        assert detach is not None and "would replace the sharded parameter" in detach


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_retain_offload_replay_give_plain_autograds_gradients_with_dropout(runs, world_size):
    """Dropout on: the three modes are bitwise equal to each other and to plain autograd on an unsharded copy."""
    for result in each_rank(runs, world_size, "modes"):
        assert result["bitwise"] == {"retain": True, "offload": True, "replay": True}, result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_sharded_graph_references_fsdps_unsharded_weights_instead_of_copying_or_counting_them(runs, world_size):
    """The bytes a retained graph holds and an offloaded one copies out are the unsharded trainer's (activations
    only: weights referenced there too). Without FSDP's unsharded storages in the keep set (their data_ptr
    moves), offload copies the gathered weights out, and the copy pins their storage: FSDP cannot free it."""
    for result in each_rank(runs, world_size, "modes"):
        retained, offloaded = result["held"]["retain"][0], result["held"]["offload"][1]
        assert retained == result["reference_held"]["retain"][0], result
        assert offloaded == result["reference_held"]["offload"][1], result
        # Without the keep set the gathered weights are copied out (more bytes), or the copy pins FSDP's storage.
        unkept = result["unkept"]
        assert "storage that is not resizable" in unkept.get("error", "") or unkept["offloaded_bytes"] > offloaded, (
            result
        )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_stale_graph_is_differentiated_at_its_forwards_weights(runs, world_size):
    """Forward A, step on B, backward A: bitwise plain autograd at the forward-time weights in every mode (the
    backward, and a replay's re-forward, gather the snapshot); without the swap FSDP gathers the stepped shards
    and the gradient is another one (guards the test). The planner counts the snapshot: this rank's shards."""
    for result in each_rank(runs, world_size, "stale"):
        for mode, found in result["modes"].items():
            assert found["bitwise"], (mode, result)
            assert found["held"] == found["shards"] > 0, (mode, result)
        assert result["unswapped_diff"] > 1e-3, result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_stale_graph_under_the_importance_policy_trains_as_the_unsharded_trainer(runs, world_size):
    for result in each_rank(runs, world_size, "stale_importance"):
        assert result["bitwise"], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_bf16_snapshot_is_half_the_bytes_and_gives_the_bf16_recipes_stale_gradient(runs, world_size):
    for result in each_rank(runs, world_size, "stale_bf16"):
        assert result["bitwise"], result
        assert result["held"] == result["shards"] > 0, result  # bf16: 2 bytes per element of the local shard


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_graphs_of_two_revisions_hold_two_snapshots_until_their_backward(runs, world_size):
    for result in each_rank(runs, world_size, "two_snapshots"):
        assert result["bitwise"], result
        assert result["held"] == 2 * result["shards"] and result["held_after"] == 0, result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_value_head_over_a_sharded_base_trains_as_the_unsharded_trainer(runs, world_size):
    """The head is replicated (summed over ranks at the step), the base sharded; a stale graph through both."""
    for result in each_rank(runs, world_size, "head"):
        assert result["bitwise"], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_fault_inside_backward_recovers_fsdp_and_the_next_backward_is_bitwise(runs, world_size):
    for result in each_rank(runs, world_size, "fault_inside_backward"):
        assert result["raised"] and "injected inside backward" in result["raised"], result
        assert result["unchanged"] and result["resharded"], result
        assert result["retry_bitwise"], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_forward_that_raises_leaves_every_unit_resharded_and_the_run_as_without_it(runs, world_size):
    """A forward raising inside decoder layer 1 (with grad, under no_grad, recorded for replay, or in a replay's
    re-forward): reference, the same run without that forward. Left gathered, the unit's next forward would skip
    its all-gather and run at the weights of before the step (the loss off by 1e-2, every weight wrong after)."""
    for result in each_rank(runs, world_size, "fault_in_forward"):
        assert sorted(result["cases"]) == sorted(["grad", "no_grad", "replay", "replay_in_backward"]), result
        for fault, found in result["cases"].items():
            assert found["raised"] and "injected inside decoder layer 1" in found["raised"], (fault, found)
            assert found["resharded"] and found["graphs_kept"] and found["resident_kept"], (fault, found)
            assert found["loss"] and found["grads"] and found["weights"], (fault, found)
