"""LoRA, bf16, a padded vocabulary and the planner's miss reports, through the pipeline's own segment and export stages.

Each test plans a tiny run and calls the segment and export entry points in
this process (one physical rank running the logical ranks), then loads the
exported checkpoint the way a user would: `PeftModel.from_pretrained` on the
base, `AutoModelForCausalLM.from_pretrained`, and compares its logits with the
trainer's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tasks.segment import _outcome
from tests.conftest import EXAMPLES, tiny_tree
from trainer_core.config import config_from_dict, load_config
from trainer_core.model import build_model, build_trainer
from trainer_core.run.export_main import export_segment
from trainer_core.run.plan import build_plan, load_segment_shard, read_plan, run_dir_for, write_plan
from trainer_core.run.records import SegmentResult
from trainer_core.run.segment_main import planner_reports_dir, segment_result_path, train_segment
from trainer_core.run.state import load_training_state, state_dir_for
from trainer_core.run.validate import validate_inputs
from trainer_core.training.memory import SavedBytesModel

RL = {
    "data": {"path": str(EXAMPLES / "tiny" / "rl.jsonl"), "kind": "rl"},
    "rl": {"sft_coef": 0.1, "initial_policy_version": 3},
}


def run_and_export(tmp_path: Path, steps: int = 4, **sections) -> tuple:
    sections.setdefault("train", {})
    sections["train"] = {"steps": steps, "steps_per_segment": 2, **sections["train"]}
    config = config_from_dict(tiny_tree(tmp_path, **sections), config_dir=tmp_path)
    plan, shards = build_plan(config)
    run_dir = run_dir_for(config, plan.run_id)
    write_plan(plan, shards, run_dir)
    results = []
    for segment in plan.segments:
        train_segment(run_dir, segment.index)
        results.append(SegmentResult.read(segment_result_path(run_dir, segment.index)))
    export_dir = tmp_path / "export"
    export_segment(run_dir, len(plan.segments) - 1, export_dir)
    return config, run_dir, results, export_dir


def trained(config, run_dir: Path):
    """The trainer at the run's last saved state, and a batch from its first shard."""
    plan = read_plan(run_dir)
    trainer = build_trainer(config)
    load_training_state(state_dir_for(run_dir, len(plan.segments) - 1), trainer.checkpoints, with_optimizer=False)
    shard = load_segment_shard(run_dir, plan.segments[0])
    trainer.model.eval()
    return trainer, shard["input_ids"][0], shard["attention_mask"][0]


def trainer_logits(trainer, input_ids, attention_mask) -> torch.Tensor:
    with torch.no_grad():
        return trainer.forward(input_ids, attention_mask, outputs=("logits",)).logits.float()


def losses(results: list[SegmentResult]) -> list[float]:
    return [loss for result in results for loss in result.losses]


def test_lora_trains_the_adapter_alone_and_exports_peft_and_merged_weights(tmp_path):
    lora = {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    config, run_dir, results, export = run_and_export(
        tmp_path, model={"lora": lora}, export={"merge_lora": True}, train={"learning_rate": 1e-2}
    )
    assert losses(results)[-1] < losses(results)[0] - 0.3
    # The training state holds the adapter alone: the base is rebuilt from model.config + run.seed.
    assert sorted(p.name for p in state_dir_for(run_dir, 1).iterdir()) == ["lora", "meta.json"]
    files = {p.relative_to(export).as_posix() for p in export.rglob("*") if p.is_file()}
    assert {
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
        "MANIFEST.json",
        "merged/config.json",
        "merged/model.safetensors",
        "merged/tokenizer.json",
    } <= files
    assert not any(name.startswith("model") for name in files)  # no full weights at the root
    trainer, ids, mask = trained(config, run_dir)
    base, _ = build_model(config)
    frozen = {n.replace(".base_layer", ""): p for n, p in trainer.model.named_parameters() if "lora_" not in n}
    assert all(torch.equal(frozen[n], p) for n, p in base.named_parameters())  # the base never moved
    expected = trainer_logits(trainer, ids, mask)
    peft_model = PeftModel.from_pretrained(base, str(export)).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(export / "merged"), local_files_only=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids, attention_mask=mask).logits, expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(merged(input_ids=ids, attention_mask=mask).logits, expected, rtol=1e-4, atol=1e-4)
        untrained = build_model(config)[0].eval()(input_ids=ids, attention_mask=mask).logits
    assert (expected - untrained).abs().max() > 1e-2  # the adapter changed the model


@pytest.mark.parametrize("objective", [{}, RL], ids=["sft", "rl"])
def test_bfloat16_runs_learn_and_their_exports_load(tmp_path, objective):
    sections = {key: dict(value) for key, value in objective.items()}
    config, run_dir, results, export = run_and_export(tmp_path, steps=6, train={"dtype": "bfloat16"}, **sections)
    curve = losses(results)
    assert sum(curve[-2:]) / 2 < sum(curve[:2]) / 2 - 0.1, curve
    weights = load_file(str(export / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    trainer, ids, mask = trained(config, run_dir)
    masters = trainer.checkpoints["base"].master_weights()
    assert masters and all(m.dtype == torch.float32 for m in masters.values())
    loaded = AutoModelForCausalLM.from_pretrained(str(export), local_files_only=True).eval()
    assert loaded.dtype == torch.bfloat16
    with torch.no_grad():
        actual = loaded(input_ids=ids, attention_mask=mask).logits.float()
    torch.testing.assert_close(actual, trainer_logits(trainer, ids, mask), rtol=0, atol=1e-6)


def test_a_padded_vocabulary_trains_and_exports_the_true_vocabulary(tmp_path):
    config, run_dir, results, export = run_and_export(tmp_path, steps=2, model={"pad_vocab_to_multiple_of": 96})
    trainer, ids, mask = trained(config, run_dir)
    assert trainer.model.get_input_embeddings().weight.shape[0] == 1056 and trainer.vocab_size == 1024
    for param in (trainer.model.get_input_embeddings().weight, trainer.model.get_output_embeddings().weight):
        assert bool((param[1024:] == 0).all())  # two steps later, still exactly zero
    weights = load_file(str(export / "model.safetensors"))
    assert weights["model.embed_tokens.weight"].shape[0] == 1024 and weights["lm_head.weight"].shape[0] == 1024
    loaded = AutoModelForCausalLM.from_pretrained(str(export), local_files_only=True).eval()
    assert loaded.config.vocab_size == 1024
    with torch.no_grad():
        actual = loaded(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(actual, trainer_logits(trainer, ids, mask), rtol=1e-5, atol=1e-5)


def test_planner_misses_are_reported_under_the_run_dir_and_counted_in_the_outcome(tmp_path, monkeypatch):
    """The plumbing: a segment's rows share one shape, so after its first graph the planner's estimate is exact
    (test_planner.py makes real misses from mixed shapes); here the estimate is doubled to make every retain miss."""
    real_estimate = SavedBytesModel.estimate
    monkeypatch.setattr(
        SavedBytesModel, "estimate", lambda self, shape: None if (e := real_estimate(self, shape)) is None else 2 * e
    )
    train = {"backward_mode": "auto", "saved_bytes_budget": 10**10}
    config, run_dir, results, _ = run_and_export(tmp_path, steps=2, train=train)
    (result,) = results
    reports = sorted(planner_reports_dir(run_dir).iterdir())
    assert result.planner_misses > 0 and result.planner.choices["offload"] >= 1
    assert len(reports) == min(result.planner_misses, 16)
    assert [p.name for p in reports][0] == "segment-0000-rank-0-miss-001.json"
    report = json.loads(reports[0].read_text())
    assert {"choice", "inputs", "predicted_peak_bytes", "observed_peak_bytes", "relative_error"} <= set(report)
    assert report["inputs"]["budget_bytes"] == 10**10
    assert _outcome(result, 1.0, reused=False).planner_misses == result.planner_misses


def test_the_keys_that_change_the_result_change_the_digest(tmp_path):
    def digest(**sections) -> str:
        return build_plan(config_from_dict(tiny_tree(tmp_path, **sections), config_dir=tmp_path))[0].digest

    base = digest()
    lora = {"lora": {"rank": 4}}
    changed = [
        digest(model=lora),
        digest(model={"lora": {"rank": 8}}),
        digest(train={"dtype": "bfloat16"}),
        digest(model={"pad_vocab_to_multiple_of": 64}),
        digest(model=lora, export={"merge_lora": True}),
    ]
    assert len({base, *changed}) == 1 + len(changed)
    assert digest(train={"planner_miss_threshold": 0.5}) == base  # what counts as a miss changes no weight


def test_the_lora_example_reads_and_passes_the_pre_flight(tmp_path):
    config = load_config(
        EXAMPLES / "tiny_lora.toml",
        [f"run.work_dir={tmp_path}/work", f"storage.url={tmp_path}/store", "train.dtype=bfloat16"],
    )
    assert config.model.lora.rank == 16 and "down_proj" in config.model.lora.target_modules
    assert config.export.merge_lora and config.train.dtype == "bfloat16"
    validate_inputs(config)  # the targets exist in the model, the data and tokenizer check out
