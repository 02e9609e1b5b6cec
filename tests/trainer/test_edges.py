"""Edges of the trainer API: replaced checkpoints, graphs that can never be differentiated, dtypes, bounds."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from tests.conftest import tiny_tree
from tests.trainer.models import batch, tiny_qwen3
from tests.trainer.test_backward_state import sft_loss
from trainer_core.config import ConfigError, config_from_dict
from trainer_core.training import (
    OptimizerConfig,
    StaleGraphError,
    StalenessPolicy,
    Trainer,
    restore_checkpoint,
    save_checkpoint,
)


def make_trainer(**staleness) -> Trainer:
    trainer = Trainer(tiny_qwen3().train(), staleness=StalenessPolicy(**staleness))
    trainer.add_base_checkpoint(optimizer=OptimizerConfig(learning_rate=1e-2))
    return trainer


def accumulate(trainer: Trainer, seed: int = 1) -> None:
    ids, mask = batch(seed=seed)
    trainer.backward(sft_loss(trainer.forward(ids, mask).logprobs, mask))


@pytest.mark.parametrize("how", ["replace", "restore"])
def test_gradients_from_before_a_replacement_are_not_applied_after_it(how, tmp_path):
    trainer = make_trainer()
    checkpoint = trainer.checkpoints["base"]
    new_weights = {n: p.detach() + 0.01 for n, p in checkpoint.parameters().items()}
    if how == "restore":
        save_checkpoint(checkpoint, tmp_path / "saved")
    accumulate(trainer)  # gradients of the old weights
    if how == "replace":
        checkpoint.replace(new_weights)
    else:
        restore_checkpoint(checkpoint, tmp_path / "saved")
        new_weights = {n: p.detach().clone() for n, p in checkpoint.parameters().items()}
    report = trainer.step()["base"]
    assert not report.stepped and report.skipped_reason == "no gradient"
    for name, param in checkpoint.parameters().items():
        assert torch.equal(param, new_weights[name]), name


def test_a_forward_under_no_grad_pins_no_weight_copy():
    trainer = make_trainer()
    ids, mask = batch()
    with torch.no_grad():
        out = trainer.forward(ids, mask)
    assert not out.logprobs.requires_grad and trainer.graphs.live() == []
    params_before = [id(p) for p in trainer.model.parameters()]
    accumulate(trainer)
    trainer.step()
    assert [id(p) for p in trainer.model.parameters()] == params_before  # stepped in place: nothing held
    assert out.logprobs.shape == (3, 11)


@pytest.mark.parametrize("mode", ["retain", "offload", "replay"])
def test_a_graph_past_the_bound_releases_its_weights_and_saved_tensors(mode):
    trainer = make_trainer(max_gradient_staleness=1)
    ids, mask = batch()
    old = trainer.forward(ids, mask, mode=mode)
    snapshot = weakref.ref(next(trainer.model.parameters()))
    accumulate(trainer)
    trainer.step()  # age 1: still within the bound, the snapshot is kept
    gc.collect()
    assert snapshot() is not None
    accumulate(trainer)
    trainer.step()  # age 2: past the bound; it can never be differentiated, so it holds nothing
    gc.collect()
    assert snapshot() is None and trainer.graphs.resident_saved_bytes() == 0
    with pytest.raises(StaleGraphError, match="2 optimizer step\\(s\\) old, over max_gradient_staleness=1"):
        trainer.backward(sft_loss(old.logprobs, mask))


def test_topk_cotangents_of_a_stale_importance_replay_are_importance_weighted():
    trainer = make_trainer(stale_mode="importance")
    low, high = trainer.staleness.importance_low, trainer.staleness.importance_high
    ids, mask = batch(seed=1)
    out = trainer.forward(ids, mask, outputs=("topk",), top_k=3, mode="replay")
    recorded, recorded_ids = out.topk_logprobs.detach().clone(), out.topk_ids.clone()
    accumulate(trainer, seed=4)
    trainer.step()
    trainer.zero_grad()
    current = copy.deepcopy(trainer.model)
    trainer.backward((out.topk_logprobs.exp() * torch.linspace(0.5, 1.5, 3)).sum())
    logits = current(input_ids=ids, attention_mask=mask).logits[:, :-1]
    now = torch.log_softmax(logits.float(), -1).gather(-1, recorded_ids)  # the same tokens as the forward's
    weights = torch.exp(now.detach() - recorded).clamp(low, high)
    cotangent = recorded.exp() * torch.linspace(0.5, 1.5, 3)  # the loss's cotangent at the managed output's value
    (weights * cotangent * now).sum().backward()
    assert not torch.equal(weights, torch.ones_like(weights))
    for live, reference in zip(trainer.model.parameters(), current.parameters()):
        torch.testing.assert_close(live.grad, reference.grad, rtol=1e-5, atol=1e-7)


def test_logprobs_keep_a_float64_models_dtype():
    trainer = Trainer(tiny_qwen3(dtype=torch.float64))
    trainer.add_base_checkpoint()
    out = trainer.forward(*batch(), outputs=("logprobs", "topk", "logits"), top_k=2)
    assert out.logprobs.dtype == out.topk_logprobs.dtype == out.logits.dtype == torch.float64


@pytest.mark.parametrize("bound", [1.5, "2", True])
def test_a_non_integer_staleness_bound_is_refused(bound):
    with pytest.raises(ValueError, match="max_gradient_staleness"):
        StalenessPolicy(max_gradient_staleness=bound)


@pytest.mark.parametrize("bound", [1.5, True])
def test_the_pipeline_refuses_a_non_integer_staleness_bound(bound, tmp_path):
    with pytest.raises(ConfigError, match="train.max_gradient_staleness"):
        config_from_dict(tiny_tree(tmp_path, train={"max_gradient_staleness": bound}), config_dir=tmp_path)
