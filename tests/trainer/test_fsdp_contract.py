"""The FSDP2 (torch 2.13) behaviour trainer_core.training.sharding relies on, pinned at W = 1 and 2 (gloo, CPU).

Private attributes and lightly documented behaviour (plan risk R3): if a
torch upgrade changes one, a test here names it. One launch per world size
runs every check (tests/trainer/fsdp_contract_worker.py).
"""

from __future__ import annotations

import pytest

from tests.trainer.sharded_ranks import each_rank, launch_results

pytestmark = pytest.mark.distributed

WORLD_SIZES = [1, 2]


@pytest.fixture(scope="module")
def runs() -> dict[int, dict]:
    return {w: launch_results("tests.trainer.fsdp_contract_worker", w) for w in WORLD_SIZES}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_private_names_sharding_uses_exist_with_their_layout(runs, world_size):
    for result in each_rank(runs, world_size, "api"):
        assert result["methods"] and result["state_has_param_groups"], result
        assert result["num_fsdp_params"] == result["num_parameters"] == 25, result
        # `_sharded_param_data`: flat, the padded local rows, and the storage the DTensor's local tensor views.
        assert result["flat_1d"] and result["padded_numel"] and result["local_view_of_flat"], result
        assert result["param_dtype_none"] and result["resharded"], result


def test_fsdp_averages_by_default_and_sums_when_told(runs):
    for result in each_rank(runs, 2, "reduce_op"):
        assert result["default"] == ["RedOpType.AVG"] and result["default_calls"] == 3, result
        assert result["sum"] == ["RedOpType.SUM"] and result["sum_calls"] == 3, result


def test_at_one_rank_fsdp_calls_no_reduce_scatter(runs):
    # A custom reduction (the deterministic fold, a later step) must fold itself at W = 1.
    (result,) = each_rank(runs, 1, "reduce_op")
    assert result["default_calls"] == result["sum_calls"] == 0, result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_unit_frees_its_gathered_weights_after_forward_and_keeps_their_identity(runs, world_size):
    # Freed after forward: a backward gathers again (so a snapshot swapped in is what it reads). The same
    # Parameter objects and storages, versions untouched: saved tensors keyed by storage stay recognisable.
    for result in each_rank(runs, world_size, "reshard_frees"):
        assert result["unsharded_bytes_after_forward"] == 0 == result["unsharded_bytes_after_backward"], result
        assert result["same_objects"] and result["same_storages"] and result["versions_unchanged"], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_autograd_grad_wrt_the_sharded_parameters_silently_finds_nothing(runs, world_size):
    # The graph's leaves are FSDP's unsharded parameters: the Trainer's autograd.grad path must change.
    for result in each_rank(runs, world_size, "autograd_grad"):
        assert result["not_none"] == 0 and result["num"] == 25, result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_backward_assigns_a_missing_shard_gradient_and_adds_to_an_existing_one(runs, world_size):
    for result in each_rank(runs, world_size, "grad_accumulates"):
        assert result["none_then_assigned"] and result["existing_then_added"], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_all_gather_reads_whatever_tensor_the_flat_shard_attribute_holds(runs, world_size, dtype):
    for result in each_rank(runs, world_size, f"all_gather_reads_flat_shard_{dtype}"):
        assert result["swapped_bitwise"] and result["restored_bitwise"], result
