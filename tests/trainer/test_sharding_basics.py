"""`shard_model` and `ShardSnapshot` (trainer_core/training/sharding.py) vs unsharded references, W = 1 and 2 (gloo).

One launch per world size runs every check (tests/trainer/sharding_worker.py):
the W = 2 launch also saves its stepped state with torch.distributed.checkpoint,
which the W = 1 launch loads. References are built on every rank from the
unsharded model fed every rank's batch: its logits, plain autograd's
per-rank gradients summed in rank order, `torch.optim.AdamW` on a full FP32
copy, and the unsharded bf16 recipe (bf16 weights cast from FP32 masters,
RoPE's inv_freq FP32).
"""

from __future__ import annotations

import pytest
import torch

from tests.trainer.models import tiny_qwen3
from tests.trainer.sharded_ranks import each_rank, launch_results
from trainer_core.parallel.fsdp.shard import decoder_layers, shard_model

pytestmark = pytest.mark.distributed

WORLD_SIZES = [1, 2]
WORKER = "tests.trainer.sharding_worker"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    state = tmp_path_factory.mktemp("dcp") / "state"
    two = launch_results(WORKER, 2, ["--dcp-save", str(state)])
    one = launch_results(WORKER, 1, ["--dcp-load", str(state), "--saved-world-size", "2"])
    return {1: one, 2: two}


def test_decoder_layers_are_the_no_split_module_classes():
    model = tiny_qwen3()
    layers = decoder_layers(model)
    assert [type(layer).__name__ for layer in layers] == ["Qwen3DecoderLayer"] * 2
    assert all(a is b for a, b in zip(layers, model.model.layers))


def test_decoder_layers_fall_back_to_model_layers():
    model = tiny_qwen3()
    model._no_split_modules = None
    assert all(a is b for a, b in zip(decoder_layers(model), model.model.layers, strict=True))


def test_a_model_without_findable_layers_is_refused_before_anything_is_sharded():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="cannot shard Sequential: no decoder layers found"):
        shard_model(model, mesh=None)  # type: ignore[arg-type]  # refused before the mesh is used
    assert type(model) is torch.nn.Sequential and type(model[0].weight) is torch.nn.Parameter


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_sharded_logits_are_bitwise_the_unsharded_models(runs, world_size):
    for result in each_rank(runs, world_size, "logits"):
        assert result["bitwise"], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_reduced_gradient_is_the_sum_of_every_ranks_unsharded_gradient(runs, world_size):
    for result in each_rank(runs, world_size, "sum_reduction"):
        assert result["bitwise"], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_one_adamw_step_is_bitwise_torch_adamw_on_a_full_fp32_copy(runs, world_size):
    for result in each_rank(runs, world_size, "adamw_step"):
        assert result["params_bitwise"] and result["moments_bitwise"] and result["num_states"] == 25, result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bf16_compute_over_fp32_masters_is_bitwise_the_unsharded_bf16_recipe(runs, world_size):
    for result in each_rank(runs, world_size, "bf16"):
        assert result["masters_dtype"] == "{torch.float32}" and result["logits_dtype"] == "torch.bfloat16", result
        assert result["logits_bitwise"] and result["grads_bitwise"], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_stale_graph_without_its_snapshot_gets_a_wrong_jacobian(runs, world_size):
    # Guards the next test: without the swap the backward gathers the stepped weights.
    for result in each_rank(runs, world_size, "stale_without_snapshot"):
        assert not result["bitwise_at_forward_weights"] and result["max_diff_at_forward_weights"] > 1e-3, result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_stale_graph_with_its_snapshot_is_differentiated_at_its_forward_weights(runs, world_size):
    for result in each_rank(runs, world_size, "stale_with_snapshot"):
        assert result["bitwise_at_forward_weights"], result
        assert result["max_diff_at_current_weights"] > 1e-3, result  # the step did move the weights
        assert result["weights_unchanged"] and result["next_forward_at_current_weights"], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_bf16_snapshot_holds_half_the_bytes_and_is_exact(runs, world_size):
    for result in each_rank(runs, world_size, "bf16_stale"):
        assert result["bitwise"] and result["live_fp32"], result
        assert 2 * result["snapshot_bytes"] == result["fp32_shard_bytes"], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_tied_embeddings_stay_in_the_root_unit(runs, world_size):
    for result in each_rank(runs, world_size, "tied"):
        assert result["bitwise"] and result["num_units"] == 4 and result["num_params"] == 24, result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_unsharded_parameter_storages_are_named_and_stable(runs, world_size):
    for result in each_rank(runs, world_size, "unsharded_storages"):
        # embedding, 2 layers, [norm, lm_head], root
        assert result["num_units"] == 5 and result["count"] == result["num_fsdp_params"] == 25, result
        assert result["stable"] and result["subset"] == [True], result


def test_a_state_saved_at_two_ranks_loads_bitwise_at_one(runs):
    for rank in (0, 1):
        assert runs[2][("dcp_saved", rank)]["ok"]
    for kind in ("sharded", "plain"):
        (result,) = each_rank(runs, 1, f"dcp_load_{kind}")
        assert result["params_bitwise"] and result["moments_bitwise"] and result["num_states"] == 25, result
