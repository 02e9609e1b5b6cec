"""`python -m bench.sharding`: the memory model's Qwen3-8B table (`--dry-run`, nothing trained), and the measured
W = 2 comparison of a sharded and a replicated trainer (one torchrun launch of a tiny model, `--quick`)."""

from __future__ import annotations

import json

import pytest

from bench import sharding


def test_the_8b_dry_run_says_only_sharding_fits_80_gb(capsys):
    result = sharding.main(["--model-config", "8b", "--dry-run"])
    out = capsys.readouterr().out.splitlines()
    assert json.loads(out[-1]) == result
    assert out[0].startswith("Qwen3-8B (8.191 B params), full fine-tune, bf16, W = 8")
    assert result["params"] == 8_190_735_360
    assert result["fits"] == {
        "none+ac=none": False,
        "none+ac=blocks": False,
        "fsdp+ac=none": True,
        "fsdp+ac=blocks": True,
    }
    sides = {(s["sharding"], s["activation_checkpointing"]): s for s in result["sides"]}
    assert sides[("fsdp", "none")]["state_gb"] == 16.38  # 16 B/param over 8 ranks, as the plan's hand table
    assert sides[("fsdp", "blocks")]["total_gb"] < sides[("fsdp", "none")]["total_gb"] < 80
    assert sides[("none", "none")]["state_gb"] > 80  # a replica's state alone does not fit


@pytest.mark.distributed
def test_the_measured_half_shards_state_to_about_half_per_rank_with_bitwise_equal_losses(capsys):
    """bf16 with logical_dp = 4 (two logical ranks per process): the replica holds FP32 masters and the fsdp side
    none, and both train bitwise alike (deterministic reduction, canonical norm, clipping at grad_clip = 1)."""
    result = sharding.main(["--quick", "--dtype", "bfloat16", "--logical-dp", "4", "--steps", "3"])
    out = capsys.readouterr().out.splitlines()
    assert json.loads(out[-1]) == result and "losses bitwise equal: True" in out[-2]
    assert result["mode"] == "measured" and result["world_size"] == 2 and result["backend"] == "gloo"
    assert result["losses_bitwise"] and result["grad_norms_bitwise"] and result["weights_bitwise"], result
    assert result["max_abs_loss_diff"] == 0.0 and len(result["baseline"]["losses"]) == 3
    none, fsdp = result["baseline"], result["candidate"]
    assert result["bytes_ratio"] == fsdp["state_bytes_per_rank"] / none["state_bytes_per_rank"] <= 0.55
    assert result["meets_target"]
    n = result["num_params"]
    # A bf16 replica: 2-byte weights, FP32 masters, two FP32 moments, FP32 gradients (the masters'): 18 B/param.
    assert none["bytes"] == {"parameters": 2 * n, "masters": 4 * n, "moments": 8 * n, "gradients": 4 * n}
    assert fsdp["bytes"]["masters"] == 0 and fsdp["bytes"]["moments"] == 2 * fsdp["bytes"]["parameters"]
    assert fsdp["bytes"]["parameters"] < 4 * n * 0.55  # FP32 shards: about half the FP32 model each
    for side in (none, fsdp):
        assert side["predicted_state_bytes"] == pytest.approx(side["state_bytes_per_rank"], rel=0.10)
        assert side["tokens_per_s"] > 0 and len(side["step_s"]) == 2  # 3 steps, 1 warm-up
    assert max(none["grad_norms"]) > 1.0  # clipping bit: the norm reached the weights


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--logical-dp", "3"], "--logical-dp 3 is not a multiple of --world-size 2"),
        (["--steps", "1"], "--steps 1: needs at least 2"),
        (["--device", "cuda", "--world-size", "64", "--logical-dp", "64"], "needs 64 GPUs"),
    ],
)
def test_the_measured_half_refuses_what_it_cannot_run_before_launching(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        sharding.main(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_a_config_json_path_works_and_a_bad_name_is_refused(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**sharding.QWEN3_8B, "num_hidden_layers": 2, "hidden_size": 256,
                                "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "head_dim": 64, "vocab_size": 1000}))  # fmt: skip
    result = sharding.main(["--model-config", str(path), "--dry-run", "--world-size", "2", "--seq-len", "64"])
    assert result["model"] == "config.json" and all(result["fits"].values())
    with pytest.raises(SystemExit, match="neither"):
        sharding.main(["--model-config", "70b", "--dry-run"])
