"""`load_sharded` (trainer_core/parallel/fsdp/load.py): meta-device init, each rank reading its own rows, W = 1, 2.

One launch per world size runs every check (tests/trainer/sharded_load_worker.py).
The reference is `from_pretrained` then `shard_model` on every rank: the loaded
shards (FSDP's flat padded local shard, padding included), RoPE's buffers and
the logits are bitwise the reference's. The bytes each rank reads are counted
outside the loader (a wrapped `safetensors.safe_open`): every byte of the files
once over all ranks, about 1/W per rank. A padded vocabulary is padded as
`build_model` pads it after `from_pretrained` (zero rows, in no file).
"""

from __future__ import annotations

import pytest

from tests.trainer.sharded_ranks import each_rank, launches_with_out

pytestmark = pytest.mark.distributed

WORLD_SIZES = [1, 2]
WORKER = "tests.trainer.sharded_load_worker"
LOADS = ["fp32_files", "fp32_one_file", "bf16_checkpoint", "bf16_compute", "tied", "padded_vocab", "padded_vocab_tied"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    return launches_with_out(WORKER, WORLD_SIZES, tmp_path_factory)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("check", LOADS)
def test_the_loaded_shards_are_bitwise_load_then_shard(runs, world_size, check):
    for result in each_rank(runs, world_size, check):
        assert result["same_names"] and result["shards_bitwise"], result
        assert result["tied"] == check.endswith("tied") and result["training"] is False, result
        assert result["true_vocab"] == result["expected_true_vocab"], result
        assert result["vocab_rows"] == (128 if check.startswith("padded") else 97), result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("check", LOADS)
def test_rope_buffers_are_computed_again_in_fp32_and_the_logits_are_bitwise(runs, world_size, check):
    for result in each_rank(runs, world_size, check):
        assert result["buffers"] == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"], result
        assert result["buffers_bitwise"] and result["inv_freq_dtype"] == "torch.float32", result
        assert result["logits_bitwise"], result
        assert result["rounded_inv_freq_moves_logits"], result  # the logits check can see a wrong inv_freq
    assert each_rank(runs, world_size, "bf16_compute")[0]["logits_dtype"] == "torch.bfloat16"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("check", LOADS)
def test_each_rank_reads_only_its_rows(runs, world_size, check):
    results = each_rank(runs, world_size, check)
    total = results[0]["file_bytes"]
    assert sum(r["measured_bytes_read"] for r in results) == total, results  # every byte once, over all ranks
    for result in results:
        assert result["measured_bytes_read"] == result["reported_bytes_read"], result
        # Never more than the rows it holds (the files and the shards are FP32 here).
        assert result["measured_bytes_read"] <= result["local_shard_bytes"] or check == "bf16_checkpoint", result
        if not check.startswith("padded"):
            # ceil(rows / W) rows per tensor: within a row per tensor of an even split. (A padded vocabulary's
            # last rows are in no file: the rank holding them reads less.)
            assert abs(result["measured_bytes_read"] - total / world_size) <= 0.02 * total, result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_loader_makes_shard_models_units(runs, world_size):
    for tied in (False, True):
        for result in each_rank(runs, world_size, f"same_units_tied_{tied}"):
            assert result["same"] and result["num"] == (4 if tied else 5), result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_checkpoint_missing_a_tensor_is_refused_on_every_rank(runs, world_size):
    for result in each_rank(runs, world_size, "missing_tensor"):
        assert result["raised"], result
        assert result["message"].endswith(
            "no tensor named model.norm.weight (nor any name tied to it) in the checkpoint"
        ), result
