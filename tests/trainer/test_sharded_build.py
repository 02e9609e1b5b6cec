"""`build_trainer` for `model.path` under fsdp: the meta-device load (each rank reads its rows) vs from_pretrained.

One launch per world size (tests/trainer/sharded_build_worker.py). The
reference is the path the load replaces: `from_pretrained` of the whole model
on every rank, the LoRA adapter injected at the run's seed, `shard_model`.
Both must give the same shards, and the same first step bit for bit. And under
bf16 the sharded run's FP32 shards are bitwise the unsharded bf16 run's
masters (its bf16 weights upcast), from an FP32 checkpoint and from a config.
"""

from __future__ import annotations

import pytest

from tests.trainer.sharded_ranks import each_rank, launches_with_out

pytestmark = pytest.mark.distributed

WORLD_SIZES = [1, 2]
WORKER = "tests.trainer.sharded_build_worker"
CHECKS = ["full_fp32", "lora_fp32", "lora_bf16_blocks_padded"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    return launches_with_out(WORKER, WORLD_SIZES, tmp_path_factory)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("check", CHECKS)
def test_the_loaded_trainer_holds_the_from_pretrained_trainers_shards(runs, world_size, check):
    """The base rows read from the files, the adapter's initial weights as peft draws them at the seed."""
    for result in each_rank(runs, world_size, check):
        assert result["same_shards"] and result["num_shards"] > 0, result
        assert (result["adapter_shards"] > 0) == check.startswith("lora"), result
        assert result["vocab"][0] == result["vocab"][1], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("check", CHECKS)
def test_the_first_step_is_bitwise_the_from_pretrained_paths(runs, world_size, check):
    for result in each_rank(runs, world_size, check):
        assert result["loss_bitwise"] and result["grads_bitwise"], result
        assert result["stepped_bitwise"] and result["moved"], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("check", ["bf16_masters_from_fp32_checkpoint", "bf16_masters_from_config"])
def test_a_sharded_bf16_run_starts_from_the_unsharded_bf16_runs_masters(runs, world_size, check):
    for result in each_rank(runs, world_size, check):
        assert result["num_masters"] > 0 and result["masters_fp32"] and result["replica_bf16"], result
        assert result["masters_bitwise"] and result["loss_bitwise"], result
