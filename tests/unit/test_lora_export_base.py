"""An exported LoRA adapter names a base that loads: peft rebuilds the trained model from the checkpoint alone.

The reference is peft's own loaders (`PeftModel.from_pretrained` on the base
the adapter's config names, `AutoPeftModelForCausalLM.from_pretrained`)
against the trainer's logits at the exported state.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from peft import AutoPeftModelForCausalLM, PeftModel
from transformers import AutoConfig, AutoModelForCausalLM

from infra.publication.local_copy import loader_line
from tests.conftest import EXAMPLES, tiny_tree
from trainer_core.config import config_from_dict
from trainer_core.model import build_model, build_trainer
from trainer_core.run.export_main import export_segment
from trainer_core.run.plan import build_plan, load_segment_shard, run_dir_for, write_plan
from trainer_core.run.segment_main import train_segment
from trainer_core.run.state import load_training_state, state_dir_for

LORA = {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def _train_and_export(tmp_path: Path, **sections):
    config = config_from_dict(
        tiny_tree(tmp_path, train={"steps": 2, "steps_per_segment": 2, "learning_rate": 1e-2}, **sections),
        config_dir=tmp_path,
    )
    plan, shards = build_plan(config)
    run_dir = run_dir_for(config, plan.run_id)
    write_plan(plan, shards, run_dir)
    train_segment(run_dir, 0)
    export_dir = tmp_path / "export"
    export_segment(run_dir, 0, export_dir)
    trainer = build_trainer(config)
    load_training_state(state_dir_for(run_dir, 0), trainer.checkpoints, with_optimizer=False)
    trainer.model.eval()
    shard = load_segment_shard(run_dir, plan.segments[0])
    ids, mask = shard["input_ids"][0], shard["attention_mask"][0]
    with torch.no_grad():
        expected = trainer.forward(ids, mask, outputs=("logits",)).logits.float()
        untrained = build_model(config)[0].eval()(input_ids=ids, attention_mask=mask).logits
    assert (expected - untrained).abs().max() > 1e-2  # the adapter changed the model: a base alone would not pass
    return config, export_dir, ids, mask, expected


def _named_base(export_dir: Path) -> str:
    named = json.loads((export_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    assert named, "adapter_config.json names no base model"
    return named


def test_an_adapter_on_a_base_built_from_a_config_names_a_base_shipped_in_the_checkpoint(tmp_path, monkeypatch):
    config, export_dir, ids, mask, expected = _train_and_export(tmp_path, model={"lora": LORA})
    assert config.model.path is None
    named = _named_base(export_dir)
    assert not Path(named).is_absolute(), "a path of the machine that exported it would not travel with the checkpoint"
    manifest = json.loads((export_dir / "MANIFEST.json").read_text())
    assert f"{named}/config.json" in {
        entry["path"] for entry in manifest["files"]
    }  # committed, pulled, verified with it
    # Following only the checkpoint: the base named relative to the adapter's directory, then the adapter on it.
    base = AutoModelForCausalLM.from_pretrained(str(export_dir / named), local_files_only=True, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(export_dir)).eval()
    monkeypatch.chdir(export_dir)  # AutoPeftModel resolves the base path as given: from the checkpoint directory
    auto_model = AutoPeftModelForCausalLM.from_pretrained(".", local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids, attention_mask=mask).logits, expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(auto_model(input_ids=ids, attention_mask=mask).logits, expected, rtol=0, atol=1e-6)


def test_an_adapter_on_a_model_path_names_that_path(tmp_path):
    base_dir = tmp_path / "base-model"  # a Hugging Face model directory, as a user brings one
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(str(EXAMPLES / "tiny" / "model_config.json"))
    ).save_pretrained(str(base_dir))
    config, export_dir, ids, mask, expected = _train_and_export(
        tmp_path, model={"lora": LORA, "path": str(base_dir), "config": None}
    )
    assert _named_base(export_dir) == str(base_dir)
    assert not (export_dir / "base").exists()  # the base is where model.path says; not copied
    auto_model = AutoPeftModelForCausalLM.from_pretrained(
        str(export_dir), local_files_only=True, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(auto_model(input_ids=ids, attention_mask=mask).logits, expected, rtol=0, atol=1e-6)


def test_the_loader_line_loads_a_copy_moved_elsewhere_from_any_directory(tmp_path, monkeypatch):
    """A pulled checkpoint lives wherever the user put it: the shipped line loads it with the cwd elsewhere."""
    _, export_dir, ids, mask, expected = _train_and_export(tmp_path, model={"lora": LORA})
    copy = tmp_path / "pulled" / "step-2"
    shutil.copytree(export_dir, copy)
    shutil.rmtree(export_dir)  # nothing left where it was exported
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    # Offline, "base" not found here is refused at once; online the hub is asked for a repo named "base" and retried
    # with backoff (23 s of sleeps) before the same OSError (huggingface_hub reads the setting at import: patched there).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError):  # peft alone reads the shipped base's name ("base") from the current directory
        AutoPeftModelForCausalLM.from_pretrained(str(copy), local_files_only=True)
    line = loader_line(copy)
    assert line is not None and f"{copy / 'base'}" in line
    namespace: dict = {}
    exec(line, namespace)  # the line exactly as `rankflow checkpoints pull` prints it
    model = namespace["model"].float().eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, expected, rtol=0, atol=1e-6)
