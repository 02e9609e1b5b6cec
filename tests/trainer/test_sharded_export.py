"""The streaming HF export of a sharded model (trainer_core/parallel/fsdp/export.py), W = 1 and 2 (gloo).

One launch per world size runs every check (tests/trainer/sharded_export_worker.py).
The reference is the unsharded export (`save_hf_model`) of a model holding the
same weights: the sharded export's files are byte for byte its files, and both
load in transformers to bitwise the same tensors and logits. Rank 0 never holds
more than one unit's gathered tensors (measured by counting the live
`full_tensor()` results, outside the writer). A byte changed in the data of a
written file is caught by the rank that owns its rows, and every rank fails.
"""

from __future__ import annotations

import pytest

from tests.trainer.sharded_ranks import each_rank, launches_with_out

pytestmark = pytest.mark.distributed

WORLD_SIZES = [1, 2]
WORKER = "tests.trainer.sharded_export_worker"
EXPORTS = ["fp32_files", "fp32_one_file", "bf16_files", "tied", "padded_vocab", "lora_base", "merged", "merged_bf16"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    return launches_with_out(WORKER, WORLD_SIZES, tmp_path_factory)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("check", EXPORTS)
def test_the_files_are_byte_for_byte_the_unsharded_export(runs, world_size, check):
    result = each_rank(runs, world_size, check)[0]
    assert result["same_names"] and not result["differing"], result
    assert any(f.endswith(".safetensors") for f in result["files"]) and "config.json" in result["files"], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("check", EXPORTS)
def test_the_export_loads_in_transformers_bitwise_equal_to_the_unsharded_export(runs, world_size, check):
    result = each_rank(runs, world_size, check)[0]
    assert result["load_bitwise"] and result["logits_bitwise"], result
    assert result["vocab"] == 97, result  # the padded vocabulary is cut to the true one


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_exports_have_the_planned_files_and_dtypes(runs, world_size):
    results = {check: each_rank(runs, world_size, check)[0] for check in EXPORTS}
    assert results["fp32_one_file"]["num_weight_files"] == 1, results["fp32_one_file"]
    assert results["fp32_files"]["num_weight_files"] > 2, results["fp32_files"]
    assert "model.safetensors.index.json" in results["fp32_files"]["files"], results["fp32_files"]
    assert results["bf16_files"]["dtype"] == "torch.bfloat16", results["bf16_files"]
    assert results["tied"]["num_tensors"] == results["fp32_files"]["num_tensors"], results["tied"]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("check", EXPORTS)
def test_no_rank_holds_more_than_one_units_gathered_tensors(runs, world_size, check):
    for result in each_rank(runs, world_size, check):
        assert 0 < result["measured_peak_bytes"] <= result["largest_unit_bytes"] < result["model_bytes"], result
        # One tensor at a time, in fact: the gather of the next starts after the last is dropped.
        assert result["measured_peak_bytes"] == result["largest_tensor_bytes"], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_rank_verifies_its_own_rows_and_together_all_of_them(runs, world_size):
    for check in EXPORTS:
        results = each_rank(runs, world_size, check)
        assert all(r["verified_bytes"] > 0 for r in results), results
    full = each_rank(runs, world_size, "fp32_one_file")
    assert sum(r["verified_bytes"] for r in full) == full[0]["model_bytes"], full
    lora = each_rank(runs, world_size, "lora_base")  # the base's bytes: the adapter is in no file
    assert sum(r["verified_bytes"] for r in lora) == full[0]["model_bytes"] < lora[0]["model_bytes"], lora
    if world_size == 2:
        assert max(r["verified_bytes"] for r in full) < 0.6 * full[0]["model_bytes"], full


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_changed_byte_is_caught_by_its_owner_and_fails_every_rank(runs, world_size):
    owner = world_size - 1  # the embedding's last row lives on the last rank
    for result in each_rank(runs, world_size, "corruption"):
        assert result["raised"], result
        assert result["message"].startswith(f"sharded export failed on rank {owner} while verifying"), result
        assert "tensor model.embed_tokens.weight rows" in result["message"], result
        assert "every rank aborted the export" in result["message"], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_write_failure_on_rank_0_fails_every_rank_without_a_hang(runs, world_size):
    for result in each_rank(runs, world_size, "write_failure"):
        assert result["raised"], result
        assert result["message"].startswith("sharded export failed on rank 0 while writing the checkpoint files"), (
            result
        )
        assert "FileNotFoundError" in result["message"], result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_merged_export_holds_the_merged_weights_and_verifies_the_rest(runs, world_size):
    base, merged = (each_rank(runs, world_size, c) for c in ("lora_base", "merged"))
    assert merged[0]["weights_sha256"] != base[0]["weights_sha256"], merged  # the merge changed q_proj and v_proj
    # Merged tensors are in no rank's shards: only the others are read back.
    assert sum(r["verified_bytes"] for r in merged) < sum(r["verified_bytes"] for r in base), (merged, base)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_staging_that_is_not_empty_is_refused_on_every_rank_and_nothing_is_written_through_a_link(runs, world_size):
    for result in each_rank(runs, world_size, "non_empty"):
        assert result["raised"] and result["untouched"], result
        assert "is not empty" in result["message"] and "export into an empty staging" in result["message"], result
