"""A resumed full fine-tune skips its weights' random initialisation (the restore writes every weight): the
segment trains bitwise like one built with it, and the export writes the same files."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.conftest import EXAMPLES, tiny_tree
from tests.plan_helpers import planned_run_dir
from trainer_core.config import config_from_dict
from trainer_core.model import build_trainer
from trainer_core.run import segment as segment_module
from trainer_core.run.plan import read_plan
from trainer_core.run.records import SegmentResult
from trainer_core.run.segment_main import segment_result_path, train_segment
from trainer_core.run.state import state_dir_for

TRAIN = {"steps": 4, "steps_per_segment": 2, "global_batch_size": 4, "logical_dp": 2, "nproc_per_node": 1}


def resumed(tmp_path: Path, monkeypatch, *, initialise: bool) -> dict:
    run_dir = planned_run_dir(config_from_dict(tiny_tree(tmp_path, train=TRAIN), config_dir=tmp_path))
    train_segment(run_dir, 0)
    calls = []
    real = segment_module.build_trainer

    def spy(config, **options):
        calls.append(options["weights_from_state"])
        return real(config, **(options | {"weights_from_state": False} if initialise else options))

    monkeypatch.setattr(segment_module, "build_trainer", spy)
    train_segment(run_dir, 1)
    assert calls == [True]
    final = state_dir_for(run_dir, 1) / "base"
    return {
        "losses": SegmentResult.read(segment_result_path(run_dir, 1)).losses,
        "weights": (final / "params.safetensors").read_bytes(),
        "optimizer": (final / "optimizer.safetensors").read_bytes(),
    }


def test_a_resumed_segment_built_without_initialisation_trains_bitwise_like_one_built_with_it(tmp_path, monkeypatch):
    skipped = resumed(tmp_path / "skipped", monkeypatch, initialise=False)
    initialised = resumed(tmp_path / "initialised", monkeypatch, initialise=True)
    assert skipped == initialised


def test_the_skipped_initialisation_is_real_and_a_lora_base_keeps_its_own(tmp_path, monkeypatch):
    """Without the restore the skipped build's weights are not the seeded ones (so the test above could fail);
    a LoRA run's frozen base is not in its state and is always initialised."""
    run_dir = planned_run_dir(config_from_dict(tiny_tree(tmp_path, train=TRAIN), config_dir=tmp_path))
    config = read_plan(run_dir).run_config()
    seeded = dict(build_trainer(config).model.named_parameters())
    skipped = dict(build_trainer(config, weights_from_state=True).model.named_parameters())
    assert any(not torch.equal(seeded[name], skipped[name]) for name in seeded)
    lora_dir = planned_run_dir(
        config_from_dict(
            tiny_tree(tmp_path / "lora", train=TRAIN, model={"lora": {"rank": 4}}), config_dir=tmp_path / "lora"
        )
    )
    lora_config = read_plan(lora_dir).run_config()
    base = {n: p for n, p in build_trainer(lora_config).model.named_parameters() if "lora_" not in n}
    kept = {
        n: p
        for n, p in build_trainer(lora_config, weights_from_state=True).model.named_parameters()
        if "lora_" not in n
    }
    assert all(torch.equal(base[name], kept[name]) for name in base)


def test_tied_embeddings_stay_tied_without_initialisation_and_resume(tmp_path, monkeypatch):
    """transformers ties the weights inside the initialisation it skips: the build ties them itself."""
    config_file = tmp_path / "tied.json"
    config_file.write_text(
        json.dumps(json.loads((EXAMPLES / "tiny" / "model_config.json").read_text()) | {"tie_word_embeddings": True})
    )
    tree = tiny_tree(tmp_path, train=TRAIN, model={"config": str(config_file)})
    run_dir = planned_run_dir(config_from_dict(tree, config_dir=tmp_path))
    config = read_plan(run_dir).run_config()
    for weights_from_state in (False, True):
        model = build_trainer(config, weights_from_state=weights_from_state).model
        assert model.lm_head.weight is model.model.embed_tokens.weight, weights_from_state
    train_segment(run_dir, 0)
    train_segment(run_dir, 1)  # resumes through the skipped initialisation
    assert SegmentResult.read(segment_result_path(run_dir, 1)).losses
