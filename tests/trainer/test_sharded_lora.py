"""LoRA adapters and a head over a sharded frozen base (`inject_lora` before `shard_model`), W = 1 and 2 (gloo).

One launch per world size runs every check (tests/trainer/sharded_lora_worker.py).
The reference is unsharded peft: the same adapters injected at the same seeds,
plain autograd through the trainer's output function with peft's `set_adapter`
switch, every rank's gradient summed in FP32 in rank order, and
`torch.optim.AdamW` on FP32 copies of the adapter weights.
"""

from __future__ import annotations

import pytest

from tests.trainer.sharded_ranks import each_rank, launches_with_out

pytestmark = pytest.mark.distributed

WORLD_SIZES = [1, 2]
WORKER = "tests.trainer.sharded_lora_worker"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    return launches_with_out(WORKER, WORLD_SIZES, tmp_path_factory)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_adapter_steps_are_bitwise_unsharded_peft_with_adamw(runs, world_size, dtype):
    """Initial adapter (bf16: rounded as the unsharded bf16 build rounds it), gradients and weights after each of
    two steps, AdamW moments: bitwise; the adapter's parameters are shards (1/W of it per rank)."""
    results = each_rank(runs, world_size, f"steps_{dtype}")
    for result in results:
        assert result["init"], result
        assert result["grads"] == [True, True] and result["weights"] == [True, True], result
        assert result["moments"], result
    total = sum(r["adapter_elements"] for r in results)
    assert all(r["adapter_elements"] <= total // world_size + 8 for r in results), results


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_frozen_base_gets_no_gradient_no_optimizer_state_and_stays_bitwise(runs, world_size, dtype):
    for result in each_rank(runs, world_size, f"steps_{dtype}"):
        assert result["base_grads"] == [] and result["base_frozen"], result
        assert result["optimizer_holds_adapter_only"], result
        assert result["base_unchanged"], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_exported_adapter_loads_with_peft_and_gives_the_trainers_logits(runs, world_size):
    result = each_rank(runs, world_size, "steps_fp32")[0]
    assert result["peft_logits_bitwise"], result
    assert result["adapter_moves_logits"] > 1e-3, result  # the trained adapter really changes the model


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_stale_graph_is_differentiated_at_its_forwards_adapter_weights(runs, world_size):
    """The snapshot holds the adapter's shards only: the frozen base is never stale."""
    for result in each_rank(runs, world_size, "stale"):
        for mode, found in result["modes"].items():
            assert found["bitwise"], (mode, result)
            assert found["held"] == found["shards"] > 0, (mode, result)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_two_adapters_trained_in_turn_are_each_bitwise_unsharded_peft(runs, world_size):
    for result in each_rank(runs, world_size, "two_adapters"):
        assert result["init"], result
        assert result["grads"] == [True, True, True], result  # and the other adapter got none
        assert result["steps"] == [[True, False], [True, False], [True, False]], result
        assert result["weights"] == {"a": True, "b": True}, result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_value_head_beside_the_adapter_trains_as_unsharded_peft(runs, world_size):
    for result in each_rank(runs, world_size, "head"):
        assert result["grads"] == {"a": True, "value": True}, result
        assert result["weights"] == {"a": True, "value": True}, result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_what_a_sharded_lora_model_cannot_do_is_refused(runs, world_size):
    for result in each_rank(runs, world_size, "refusals"):
        never, base, taken, other = result["messages"]
        assert never is not None and "cannot add LoRA adapter 'b' to a sharded model" in never, result
        assert "inject it before sharding" in never and "(injected: ['a'])" in never, result
        assert base is not None and "cannot register a base checkpoint on a sharded model" in base, result
        assert taken is not None and "already holds a LoRA adapter named 'a'" in taken, result
        assert other is not None and "was injected with another config" in other, result
