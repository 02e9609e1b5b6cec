"""Transactional gradients, per-checkpoint AdamW, and graphs freed when their outputs go."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from tests.trainer.models import batch, tiny_qwen3
from tests.trainer.test_backward_state import sft_loss
from trainer_core.training import GradientTransactionError, GraphConsumedError, OptimizerConfig, Trainer


def trainer_with_grads() -> Trainer:
    trainer = Trainer(tiny_qwen3().train())
    trainer.add_base_checkpoint()
    ids, mask = batch(seed=7)
    out = trainer.forward(ids, mask)
    trainer.backward(sft_loss(out.logprobs, mask))  # accumulators now hold something
    return trainer


def test_a_failure_mid_backward_leaves_every_grad_bitwise_unchanged(monkeypatch):
    trainer = trainer_with_grads()
    before = [p.grad.clone() for p in trainer.model.parameters()]
    first, second = (trainer.forward(*batch(seed=s)) for s in (1, 2))

    def loss_of_both():
        return sft_loss(first.logprobs, batch(seed=1)[1]) + sft_loss(second.logprobs, batch(seed=2)[1])

    real = trainer._differentiate
    calls = []

    def fail_on_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure in the second graph")
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "_differentiate", fail_on_second)
    with pytest.raises(RuntimeError, match="injected failure in the second graph"):
        trainer.backward(loss_of_both())
    assert len(calls) == 2
    for grad, old in zip((p.grad for p in trainer.model.parameters()), before):
        assert torch.equal(grad, old)
    monkeypatch.setattr(trainer, "_differentiate", real)
    trainer.backward(loss_of_both())  # the model graphs survived the failed attempt
    assert any(not torch.equal(p.grad, old) for p, old in zip(trainer.model.parameters(), before))


def test_non_finite_gradient_is_refused_by_default_and_changes_nothing():
    trainer = trainer_with_grads()
    before = [p.grad.clone() for p in trainer.model.parameters()]
    ids, mask = batch(seed=3)
    out = trainer.forward(ids, mask)
    with pytest.raises(GradientTransactionError, match="non-finite gradient"):
        trainer.backward(out.logprobs.sum() * float("inf"))
    assert all(torch.equal(p.grad, old) for p, old in zip(trainer.model.parameters(), before))


def test_non_finite_norm_skips_the_step_and_clears_gradients():
    trainer = Trainer(tiny_qwen3().train(), nonfinite="skip")
    checkpoint = trainer.add_base_checkpoint()
    weights = [p.detach().clone() for p in trainer.model.parameters()]
    ids, mask = batch(seed=3)
    out = trainer.forward(ids, mask)
    trainer.backward(out.logprobs.sum() * float("nan"))
    report = trainer.step()["base"]
    assert not report.stepped and report.version.revision == 0 and checkpoint.revision == 0
    assert all(torch.equal(p, w) for p, w in zip(trainer.model.parameters(), weights))
    assert all(p.grad is None for p in trainer.model.parameters())


def test_adamw_per_checkpoint_matches_torch_adamw():
    config = OptimizerConfig(learning_rate=3e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1, grad_clip=0.5)
    model = tiny_qwen3().train()
    reference = copy.deepcopy(model)
    head, reference_head = torch.nn.Linear(32, 1), None
    reference_head = copy.deepcopy(head)
    trainer = Trainer(model)
    trainer.add_base_checkpoint(optimizer=config)
    trainer.add_module_checkpoint("value", head, optimizer=OptimizerConfig(learning_rate=1e-1, grad_clip=0.0))
    reference_optimizers = [
        (
            list(reference.parameters()),
            torch.optim.AdamW(reference.parameters(), lr=3e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1),
            0.5,
        ),
        (
            list(reference_head.parameters()),
            torch.optim.AdamW(reference_head.parameters(), lr=1e-1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0),
            None,
        ),
    ]
    for step in range(3):
        ids, mask = batch(seed=step)
        out = trainer.forward(ids, mask, outputs=("logprobs", "heads"))
        trainer.backward(sft_loss(out.logprobs, mask) + out.heads["value"].pow(2).mean())
        reports = trainer.step()
        assert reports["base"].version.revision == reports["value"].version.revision == step + 1
        result = reference(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        logprobs = torch.log_softmax(result.logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        (sft_loss(logprobs, mask) + reference_head(result.hidden_states[-1]).pow(2).mean()).backward()
        for params, optimizer, clip in reference_optimizers:
            if clip:
                torch.nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
            optimizer.zero_grad()
    for mine, theirs in [(model, reference), (head, reference_head)]:
        for p, q in zip(mine.parameters(), theirs.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_dropping_the_outputs_releases_the_graph():
    trainer = Trainer(tiny_qwen3().train())
    trainer.add_base_checkpoint()
    ids, mask = batch(size=4, length=32)
    out = trainer.forward(ids, mask, outputs=("logprobs", "logits"), mode="retain")
    graph = trainer.graphs.live()[0]
    internal = weakref.ref(graph.state.outputs["logprobs"])
    assert trainer.graphs.resident_saved_bytes() > 0
    del graph
    loss = out.logprobs.sum()
    del out
    gc.collect()
    assert trainer.graphs.live() != []  # the loss still holds a managed output
    del loss
    gc.collect()
    assert trainer.graphs.live() == [] and trainer.graphs.resident_saved_bytes() == 0
    assert internal() is None  # the autograd graph and its saved tensors are gone


def test_a_consumed_graph_cannot_be_backwarded_twice_without_retain_graph():
    trainer = Trainer(tiny_qwen3().train())
    trainer.add_base_checkpoint()
    ids, mask = batch()
    out = trainer.forward(ids, mask)
    trainer.backward(out.logprobs.sum(), retain_graph=True)
    trainer.backward(out.logprobs.sum())
    with pytest.raises(GraphConsumedError, match="retain_graph=True"):
        trainer.backward(out.logprobs.sum())


def test_a_loss_without_managed_outputs_is_refused():
    trainer = Trainer(tiny_qwen3())
    trainer.add_base_checkpoint()
    with pytest.raises(ValueError, match="depends on no managed output"):
        trainer.backward(torch.ones(2, requires_grad=True).sum())
