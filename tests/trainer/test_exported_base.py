"""An export is an ordinary Hugging Face checkpoint: it keeps the base's `use_cache` and is a base for the next run.

Training must not need `use_cache=False` in the model's config (the trainer's
forwards ask for no cache themselves, so packed rows stay apart whatever the
config says), the export's config.json says what the base's said, and the
pre-flight accepts any valid checkpoint as `model.path` — one saved with
`use_cache=false` included.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import EXAMPLES, tiny_tree
from tests.trainer.models import tiny_qwen3
from tests.trainer.test_pipeline_models import run_and_export
from trainer_core.config import config_from_dict
from trainer_core.model import build_model
from trainer_core.model_checks import check_model
from trainer_core.run.validate import validate_inputs
from trainer_core.training import Trainer

TOKENIZER_VOCAB = 1024


@pytest.mark.parametrize("use_cache", [False, True])
def test_packed_documents_stay_apart_through_the_trainer_whatever_the_configs_use_cache(use_cache):
    """The reference: each document on its own. With a KV cache transformers skips its packing detection."""
    model = tiny_qwen3().eval()
    model.config.use_cache = use_cache
    trainer = Trainer(model)
    trainer.add_base_checkpoint()
    generator = torch.Generator().manual_seed(0)
    first, second = torch.randint(3, 97, (1, 5), generator=generator), torch.randint(3, 97, (1, 7), generator=generator)
    packed = torch.cat([first, second], dim=1)
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with torch.no_grad():
        together = trainer.forward(packed, None, position_ids=positions).logprobs
        alone = trainer.forward(second, None).logprobs
    # Position 4 predicts the second document's first token across the boundary: not comparable; the rest is.
    torch.testing.assert_close(together[0, 5:], alone[0], rtol=0, atol=1e-6)
    assert model.config.use_cache is use_cache  # the trainer left the config as it found it


def _model_config(tmp_path: Path, use_cache: bool) -> str:
    raw = json.loads((EXAMPLES / "tiny" / "model_config.json").read_text())
    raw["use_cache"] = use_cache
    path = tmp_path / f"model_config_{use_cache}.json"
    path.write_text(json.dumps(raw))
    return str(path)


@pytest.mark.parametrize("use_cache", [True, False])
def test_the_export_keeps_the_bases_use_cache(tmp_path, use_cache):
    _, _, _, export = run_and_export(tmp_path, steps=2, model={"config": _model_config(tmp_path, use_cache)})
    assert json.loads((export / "config.json").read_text())["use_cache"] is use_cache
    assert AutoConfig.from_pretrained(str(export)).use_cache is use_cache


def _run_on(tmp_path: Path, base: Path):
    tree = tiny_tree(tmp_path, model={"path": str(base), "config": None})
    return config_from_dict(tree, config_dir=tmp_path)


def test_a_checkpoint_saved_with_use_cache_false_passes_the_model_check(tmp_path):
    """Not rankflow's own export: any Hugging Face checkpoint a trainer saved with use_cache=false."""
    model_config = AutoConfig.from_pretrained(_model_config(tmp_path, False))
    AutoModelForCausalLM.from_config(model_config).save_pretrained(str(tmp_path / "saved"))
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["use_cache"] is False
    checked = check_model(_run_on(tmp_path, tmp_path / "saved"), TOKENIZER_VOCAB)
    assert checked.vocab_size == TOKENIZER_VOCAB


def test_an_export_is_the_base_of_the_next_run(tmp_path):
    """The newcomer's path: train, export, then train on the export as model.path (pre-flight to export)."""
    _, _, _, export = run_and_export(tmp_path / "first", steps=2)
    second = _run_on(tmp_path / "second", export)
    validate_inputs(second)  # the pre-flight forward check included
    config, _, results, second_export = run_and_export(
        tmp_path / "second", steps=2, model={"path": str(export), "config": None}
    )
    assert config.model.path == str(export) and len(results) == 1
    # The second run's base is the first run's export, bit for bit; its own export moved on from there and is
    # again an ordinary checkpoint.
    first = AutoModelForCausalLM.from_pretrained(str(export), local_files_only=True)
    base, _ = build_model(config)
    for (name, param), expected in zip(base.named_parameters(), first.parameters()):
        assert torch.equal(param, expected), name
    assert json.loads((second_export / "config.json").read_text())["use_cache"] is True
    loaded = AutoModelForCausalLM.from_pretrained(str(second_export), local_files_only=True)
    moved = max((a - b).abs().max().item() for a, b in zip(first.parameters(), loaded.parameters()))
    assert 0 < moved < 0.5
