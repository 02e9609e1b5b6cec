"""A LoRA adapter exported from a sharded peft model (trainer_core/parallel/fsdp/adapter_export.py), W = 1 and 2 (gloo).

One launch per world size (tests/trainer/sharded_adapter_worker.py). The
reference is the unsharded export (`export_checkpoint_module`) of the same
adapter: the files are byte for byte its files, `PeftModel.from_pretrained`
over a fresh base gives the sharded model's logits bitwise, each rank verifies
only its rows, and a changed byte fails every rank.
"""

from __future__ import annotations

import pytest

from tests.trainer.sharded_ranks import each_rank, launches_with_out

pytestmark = pytest.mark.distributed

WORLD_SIZES = [1, 2]
WORKER = "tests.trainer.sharded_adapter_worker"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    return launches_with_out(WORKER, WORLD_SIZES, tmp_path_factory)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_adapter_files_are_byte_for_byte_the_unsharded_export(runs, world_size):
    result = each_rank(runs, world_size, "adapter")[0]
    assert result["files"] == ["adapter_config.json", "adapter_model.safetensors"], result
    assert result["same_names"] and result["same_bytes"], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_peft_loads_the_adapter_and_reproduces_the_sharded_models_logits(runs, world_size):
    result = each_rank(runs, world_size, "adapter")[0]
    assert result["peft_logits_bitwise"], result
    assert result["adapter_moves_logits"] > 1e-3, result  # the adapter really changes the model


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_each_rank_verifies_its_rows_of_the_adapter(runs, world_size):
    results = each_rank(runs, world_size, "adapter")
    assert sum(r["verified_bytes"] for r in results) == results[0]["adapter_bytes"], results
    assert all(r["verified_bytes"] == results[0]["adapter_bytes"] // world_size for r in results), results


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_changed_adapter_byte_is_caught_by_its_owner_and_fails_every_rank(runs, world_size):
    for result in each_rank(runs, world_size, "adapter_corruption"):
        assert result["raised"], result
        assert result["message"].startswith(f"sharded export failed on rank {world_size - 1} while verifying"), result
        assert "v_proj.lora_B.weight rows" in result["message"], result
