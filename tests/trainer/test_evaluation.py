"""Evaluation during training: the eval loss against a float64 reference, and training bitwise unchanged by it.

Segments are planned from the shipped tiny data and trained in this process (W = 1, L = 2). The reference loads
the saved weights into a fresh transformers model in float64 and computes the mean negative log-likelihood of the
held-out assistant tokens from its logits, one conversation at a time, from the held-out file's own tokens (the
plan's eval shard is only used to check that it holds those conversations). The run with evaluation is compared
with the same run without it: losses, gradient norms, weights and AdamW moments bitwise equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import EXAMPLES, tiny_tree
from tests.plan_helpers import planned_run_dir
from trainer_core.config import config_from_dict
from trainer_core.data import DataError
from trainer_core.errors import ConfigError
from trainer_core.run.plan import load_eval_shard, read_plan
from trainer_core.run.records import SegmentResult
from trainer_core.run.segment_main import segment_result_path, train_segment
from trainer_core.run.state import state_dir_for

EVAL_FILE = EXAMPLES / "tiny" / "eval.jsonl"
TRAIN = {"steps": 4, "steps_per_segment": 2, "global_batch_size": 4, "logical_dp": 2, "nproc_per_node": 1}


def planned(tmp_path: Path, data: dict | None = None, train: dict | None = None, **sections) -> Path:
    tree = tiny_tree(tmp_path, train={**TRAIN, **(train or {})}, **sections)
    tree["data"].update(data or {})
    return planned_run_dir(config_from_dict(tree, config_dir=tmp_path))


def trained(run_dir: Path) -> dict:
    for segment in (0, 1):
        train_segment(run_dir, segment)
    results = [SegmentResult.read(segment_result_path(run_dir, s)) for s in (0, 1)]
    final = state_dir_for(run_dir, 1) / "base"
    return {
        "losses": [loss for r in results for loss in r.losses],
        "grad_norms": [norm for r in results for norm in r.grad_norms],
        "weights": (final / "params.safetensors").read_bytes(),
        "optimizer": (final / "optimizer.safetensors").read_bytes(),
        "peak_saved_bytes": [r.peak_saved_bytes for r in results],  # evaluation keeps no graph
        "eval_steps": [step for r in results for step in r.eval_steps],
        "eval_losses": [loss for r in results for loss in r.eval_losses],
    }


def reference_eval_loss(run_dir: Path, held_out: list[list[int]], masks: list[list[bool]]) -> float:
    """Float64 transformers forward of the saved weights, each held-out conversation alone, no padding at all."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads((EXAMPLES / "tiny" / "model_config.json").read_text()))
    model = AutoModelForCausalLM.from_config(config).double().eval()
    weights = load_file(str(state_dir_for(run_dir, 1) / "base" / "params.safetensors"))
    model.load_state_dict({name: tensor.double() for name, tensor in weights.items()}, strict=True)
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, mask in zip(held_out, masks):
            tokens = torch.tensor([ids])
            logprobs = torch.log_softmax(model(tokens).logits[0, :-1], dim=-1)
            target = logprobs.gather(1, tokens[0, 1:, None])[:, 0]
            chosen = torch.tensor(mask[1:])
            total -= float(target[chosen].sum())
            count += int(chosen.sum())
    return total / count


def held_out_tokens(run_dir: Path) -> tuple[list[list[int]], list[list[bool]]]:
    """Each held-out conversation's tokens and loss mask, rendered by the data stages from eval.jsonl itself."""
    from trainer_core.data import DataOptions, load_chat_template, load_tokenizer, prepare, read_records

    config = read_plan(run_dir).run_config()
    template = load_chat_template(config.tokenizer.path)
    options = DataOptions.from_config(config.data)
    prepared = prepare(read_records(str(EVAL_FILE)), load_tokenizer(config.tokenizer.path), template, options)
    ids = [list(map(int, d.input_ids)) for d in prepared.documents]
    masks = [list(map(bool, d.loss_mask)) for d in prepared.documents]
    return ids, masks


def test_the_eval_loss_is_the_float64_mean_over_held_out_assistant_tokens(tmp_path):
    run_dir = planned(tmp_path, {"eval_path": str(EVAL_FILE)})
    outcome = trained(run_dir)
    assert outcome["eval_steps"] == [1, 3]  # each segment's last step (eval_every unset)
    ids, masks = held_out_tokens(run_dir)
    plan = read_plan(run_dir)
    shard = load_eval_shard(run_dir, plan)
    assert shard is not None and plan.num_eval_conversations == len(ids) == 100
    assert plan.eval_loss_tokens == sum(sum(m[1:]) for m in masks)
    expected = reference_eval_loss(run_dir, ids, masks)
    assert outcome["eval_losses"][-1] == pytest.approx(expected, rel=1e-5)
    assert outcome["eval_losses"][0] != pytest.approx(expected, rel=1e-3)  # the first is of other weights


def test_evaluation_changes_no_training_result(tmp_path):
    without = trained(planned(tmp_path / "a"))
    evaluated = trained(planned(tmp_path / "b", {"eval_path": str(EVAL_FILE)}, {"eval_every": 1}))
    assert evaluated["eval_steps"] == [0, 1, 2, 3] and without["eval_steps"] == []
    for key in ("losses", "grad_norms", "weights", "optimizer", "peak_saved_bytes"):
        assert evaluated[key] == without[key], key


def test_a_held_out_fraction_leaves_training_and_is_seeded(tmp_path):
    run_dir = planned(tmp_path, {"eval_fraction": 0.1})
    plan = read_plan(run_dir)
    assert plan.num_eval_conversations == 120  # 10% of the 1,200 conversations
    again = planned(tmp_path / "again", {"eval_fraction": 0.1})
    assert read_plan(again).run_id == plan.run_id  # the same seed: the same split, the same plan
    other_seed = planned(tmp_path / "seed", {"eval_fraction": 0.1}, run={"seed": 8})
    held = load_eval_shard(run_dir, plan)
    assert held is not None
    other = load_eval_shard(other_seed, read_plan(other_seed))
    assert other is not None and not torch.equal(held["input_ids"], other["input_ids"])
    assert plan.num_tokens < read_plan(planned(tmp_path / "all")).num_tokens  # the held-out tokens left training


def test_the_split_is_disjoint_complete_and_keeps_file_order():
    import numpy as np

    from trainer_core.data import Prepared
    from trainer_core.data_kinds import SFT_DATA
    from trainer_core.run.held_out import split_held_out

    names = [f"doc-{i}" for i in range(50)]
    prepared = Prepared(names, [f"f:{i}" for i in range(50)], np.arange(50) + 10, SFT_DATA, 50)
    trained, held = split_held_out(prepared, 0.2, seed=3, label="f")
    assert len(held.documents) == 10 and len(trained.documents) == 40
    assert sorted([*trained.documents, *held.documents], key=names.index) == names
    assert list(held.documents) == sorted(held.documents, key=names.index)  # file order on both sides
    assert [int(n) for n in held.lengths] == [names.index(d) + 10 for d in held.documents]
    assert list(split_held_out(prepared, 0.2, seed=3, label="f")[1].documents) == list(held.documents)
    assert list(split_held_out(prepared, 0.2, seed=4, label="f")[1].documents) != list(held.documents)
    assert len(split_held_out(prepared, 0.001, seed=3, label="f")[1].documents) == 1  # at least one


def test_a_fraction_that_leaves_nothing_to_train_is_bad_input(tmp_path):
    small = tmp_path / "two.jsonl"
    small.write_text("".join(EVAL_FILE.read_text().splitlines(keepends=True)[:2]))
    with pytest.raises(DataError, match=r"data.eval_fraction=0.9 of 2 conversation\(s\) leaves none to train on"):
        planned(tmp_path, {"path": str(small), "eval_fraction": 0.9})


@pytest.mark.parametrize(
    ("data", "train", "message"),
    [
        ({"eval_path": str(EVAL_FILE), "eval_fraction": 0.1}, {}, "keep eval_path .* or eval_fraction"),
        ({}, {"eval_every": 5}, "train.eval_every=5 but there is nothing to evaluate"),
        ({"eval_path": "missing.jsonl"}, {}, "data.eval_path=.*missing.jsonl' does not exist; point it at"),
    ],
)
def test_eval_settings_that_cannot_work_are_refused(tmp_path, data, train, message):
    tree = tiny_tree(tmp_path, train={**TRAIN, **train})
    tree["data"].update(data)
    with pytest.raises(ConfigError, match=message):
        config_from_dict(tree, config_dir=tmp_path)


def test_a_bad_held_out_record_names_its_file_and_line(tmp_path):
    bad = tmp_path / "eval.jsonl"
    bad.write_text(EVAL_FILE.read_text().splitlines()[0] + '\n{"messages": [{"role": "user"}]}\n')
    with pytest.raises(DataError, match=rf"{bad}:2"):
        planned(tmp_path, {"eval_path": str(bad)})
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").glob("test-*"))


def test_the_held_out_rl_loss_counts_every_trajectory_whatever_policy_sampled_it():
    """The staleness bound decides what trains; measured on held-out rows it would drop them from the loss (a
    held-out loss biased to 0) or refuse them mid-run (`stale_trajectories = "error"`)."""
    from trainer_core.objectives import ClippedPolicyGradient

    torch.manual_seed(0)
    rows = {
        "loss_mask": torch.ones(2, 6, dtype=torch.bool),
        "behaviour_logprobs": -torch.rand(2, 6),
        "advantages": torch.randn(2, 6),
        "policy_version": torch.tensor([[0] * 6, [5] * 6]),
    }
    logprobs = -torch.rand(2, 5)
    settings = {"clip_low": 0.2, "clip_high": 0.28, "sft_coef": 0.1, "initial_policy_version": 5}
    unbounded = ClippedPolicyGradient(**settings, max_data_staleness=None, stale_trajectories="drop")
    expected = unbounded.loss_sum(logprobs, rows, revision=0).loss
    for policy in ("drop", "error"):
        bounded = ClippedPolicyGradient(**settings, max_data_staleness=1, stale_trajectories=policy)  # type: ignore[arg-type]
        measured = bounded.for_evaluation().loss_sum(logprobs, rows, revision=0)
        assert torch.equal(measured.loss, expected) and measured.num_dropped == 0
    dropping = ClippedPolicyGradient(**settings, max_data_staleness=1, stale_trajectories="drop")
    assert dropping.loss_sum(logprobs, rows, revision=0).num_dropped == 1  # training still drops the old one


def test_a_held_out_rl_set_is_measured_whole_after_training_left_its_policies_behind(tmp_path):
    """RL held out from trajectories of policies 0-3, staleness bound 0: after one step every one is stale for
    training, none for evaluation (it measured exactly 0.0 when the bound applied there)."""
    rl = {"path": str(EXAMPLES / "tiny" / "rl.jsonl"), "kind": "rl", "max_seq_len": 160, "eval_fraction": 0.2}
    bound = {"initial_policy_version": 3, "max_data_staleness": 0, "stale_trajectories": "drop"}
    outcome = trained(planned(tmp_path, rl, rl=bound))
    assert outcome["eval_steps"] == [1, 3] and all(loss != 0.0 for loss in outcome["eval_losses"])


def test_the_memory_check_counts_held_out_rows_longer_than_the_training_rows(tmp_path):
    """Held-out rows are as long as their longest conversation: a forward over them holds more than a training
    forward where they are longer, and the pre-flight's prediction (train.device_memory_gb) must say so."""
    from trainer_core.run.validate import validate_inputs

    long_reply = " ".join(["The capital of Japan is Tokyo."] * 40)
    long_file = tmp_path / "long.jsonl"
    record = {"messages": [{"role": "user", "content": "Repeat."}, {"role": "assistant", "content": long_reply}]}
    long_file.write_text(json.dumps(record) + "\n")

    def predicted(data: dict) -> int:
        tree = tiny_tree(tmp_path, train=TRAIN)
        tree["data"].update({"max_seq_len": 512, **data})
        checked = validate_inputs(config_from_dict(tree, config_dir=tmp_path))
        assert checked.memory is not None
        checked.store.close()
        return checked.memory.estimate.total

    assert predicted({"eval_path": str(long_file)}) > predicted({}) == predicted({"eval_path": str(EVAL_FILE)})


def test_evaluation_puts_back_each_modules_own_mode(tmp_path):
    """A caller's module left in eval() inside a training model stays so; the rest train again."""
    from trainer_core.model import build_trainer
    from trainer_core.ranks import LogicalDataParallel, Topology
    from trainer_core.run.evaluation import evaluate

    run_dir = planned(tmp_path, {"eval_path": str(EVAL_FILE)})
    plan = read_plan(run_dir)
    trainer = build_trainer(plan.run_config())
    ldp = LogicalDataParallel(trainer, Topology(0, 1, 1))
    trainer.model.train()
    frozen = trainer.model.get_submodule("model.layers.0.self_attn.q_norm").eval()
    rng = torch.get_rng_state()
    rows = load_eval_shard(run_dir, plan)
    assert rows is not None
    from trainer_core.objectives import SFT

    loss = evaluate(trainer, ldp, SFT(), rows, revision=0, rows_per_forward=4, loss_tokens=plan.eval_loss_tokens)
    assert loss > 0 and torch.equal(torch.get_rng_state(), rng) and torch.is_grad_enabled()
    assert not frozen.training and trainer.model.training and trainer.model.model.layers[1].training
    assert all(p.grad is None for p in trainer.model.parameters())
