"""A run with `train.activation_checkpointing = "blocks"` is the run without it: same id, losses, state and export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import trainer_core.model
from tests.conftest import EXAMPLES
from tests.trainer.test_pipeline_models import losses, run_and_export
from trainer_core.run.plan import read_plan
from trainer_core.run.state import state_dir_for


def files_of(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_checkpointed_run_commits_bitwise_the_weights_of_the_plain_run(tmp_path, monkeypatch):
    # The example's model with dropout on: the recompute must replay the forward's draws too.
    model_config = json.loads((EXAMPLES / "tiny" / "model_config.json").read_text())
    model_config["attention_dropout"] = 0.1
    config_file = tmp_path / "model_config.json"
    config_file.write_text(json.dumps(model_config))
    checkpointed_layers = []
    blocks = trainer_core.model.checkpoint_blocks
    monkeypatch.setattr(trainer_core.model, "checkpoint_blocks", lambda m: checkpointed_layers.append(blocks(m)))
    runs = {}
    for setting in ("none", "blocks"):
        before = len(checkpointed_layers)
        runs[setting] = run_and_export(
            tmp_path / setting,
            steps=4,
            model={"config": str(config_file)},
            train={"activation_checkpointing": setting},
        )
        assert (len(checkpointed_layers) > before) is (setting == "blocks")  # segments and the export build with it
    assert set(checkpointed_layers) == {2}
    (_, plain_dir, plain_results, plain_export), (_, ac_dir, ac_results, ac_export) = runs["none"], runs["blocks"]
    assert read_plan(plain_dir).run_id == read_plan(ac_dir).run_id  # out of the digest: the same run
    assert losses(plain_results) == losses(ac_results)
    exported = files_of(plain_export)
    assert "model.safetensors" in exported
    assert files_of(ac_export) == exported
    last = len(read_plan(plain_dir).segments) - 1
    plain_state, ac_state = files_of(state_dir_for(plain_dir, last)), files_of(state_dir_for(ac_dir, last))
    # A version's identity is drawn afresh per trainer (training/versions.py); everything else is bitwise the same.
    versions = [name for name in plain_state if name.endswith("version.json")]
    assert versions and all(json.loads(ac_state.pop(n))["revision"] == 4 for n in versions)
    assert all(json.loads(plain_state.pop(n))["revision"] == 4 for n in versions)
    assert ac_state == plain_state


@pytest.mark.parametrize("setting", ["blocks", "none"])
def test_the_key_reads_from_a_config_file(tmp_path, setting):
    from trainer_core.config import load_config
    from trainer_core.run.plan import digest_view

    config = load_config(
        EXAMPLES / "tiny_sft.toml",
        [f"run.work_dir={tmp_path}/work", f"storage.url={tmp_path}/store", f"train.activation_checkpointing={setting}"],
    )
    assert config.train.activation_checkpointing == setting
    assert "activation_checkpointing" not in digest_view(config)["train"]  # how much is kept, not what is trained
