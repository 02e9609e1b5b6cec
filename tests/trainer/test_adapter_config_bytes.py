"""A LoRA adapter's adapter_config.json has the same bytes in every process.

peft keeps target_modules as a set and writes `list(set)`: the order of the process's hash seed (three launches,
three files). `_HashOrder` stands for one such order, fixed here: the reverse of the sorted one.
"""

from __future__ import annotations

import json

from peft import LoraConfig

from tests.trainer.models import tiny_qwen3
from trainer_core.training import Trainer, export_checkpoint_module
from trainer_core.training.adapter_config import save_adapter_config

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class _HashOrder(set):
    """A set that iterates in an order of its own, as a set does under another hash seed."""

    def __iter__(self):
        return iter(sorted(super().__iter__(), reverse=True))


def _config() -> LoraConfig:
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, task_type="CAUSAL_LM")
    config.target_modules = _HashOrder(TARGETS)  # pyright: ignore[reportAttributeAccessIssue] - a set, as peft's own
    return config


def test_the_written_set_is_a_sorted_list_and_the_rest_is_peft_s(tmp_path):
    config = _config()
    config.save_pretrained(str(tmp_path / "peft"))
    save_adapter_config(config, tmp_path / "ours")
    peft_written = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    written = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert peft_written["target_modules"] == sorted(TARGETS, reverse=True)  # peft writes the set's own order
    assert written["target_modules"] == sorted(TARGETS)
    assert written == {**peft_written, "target_modules": sorted(TARGETS)}
    assert list(written) == list(peft_written)  # peft's key order too


def test_peft_reads_the_sorted_list_back_as_its_set(tmp_path):
    config = _config()
    save_adapter_config(config, tmp_path)
    loaded = LoraConfig.from_pretrained(str(tmp_path))
    assert loaded.target_modules == set(TARGETS)
    assert loaded.to_dict() == LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, task_type="CAUSAL_LM").to_dict()


def test_the_export_writes_it_in_the_fixed_order(tmp_path):
    trainer = Trainer(tiny_qwen3())
    trainer.add_lora_checkpoint("adapter", _config())
    export_checkpoint_module(trainer, "adapter", tmp_path)
    written = json.loads((tmp_path / "adapter_config.json").read_text())
    assert written["target_modules"] == sorted(TARGETS)
