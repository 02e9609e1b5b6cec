"""`python -m bench.sharding --dry-run`: the memory model's Qwen3-8B table and its JSON line (nothing trained)."""

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


def test_the_measured_half_is_refused_until_the_trainer_shards(capsys):
    with pytest.raises(SystemExit) as stopped:
        sharding.main([])
    assert stopped.value.code == 2 and "--dry-run" in capsys.readouterr().err


def test_a_config_json_path_works_and_a_bad_name_is_refused(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**sharding.QWEN3_8B, "num_hidden_layers": 2, "hidden_size": 256,
                                "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "head_dim": 64, "vocab_size": 1000}))  # fmt: skip
    result = sharding.main(["--model-config", str(path), "--dry-run", "--world-size", "2", "--seq-len", "64"])
    assert result["model"] == "config.json" and all(result["fits"].values())
    with pytest.raises(SystemExit, match="neither"):
        sharding.main(["--model-config", "70b", "--dry-run"])
