"""The gradient commit is atomic and its accumulators are the caller's alone.

Every new accumulator is built (dense, contiguous, its own storage) before any
is published; autograd's stride-0 or shared gradient tensors never become a
`.grad`. The reference is plain autograd on a deep copy, and torch.optim.AdamW.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.trainer.models import batch, tiny_qwen3
from tests.trainer.test_backward_state import sft_loss
from trainer_core.training import OptimizerConfig, Trainer


class SummedBiasHead(nn.Module):
    """A head whose bias enters through `p.sum()`: autograd hands back a stride-0 gradient."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 1)
        self.offset = nn.Parameter(torch.randn(8))

    def forward(self, hidden):
        return self.proj(hidden) + self.offset.sum()


class SharedSumHead(nn.Module):
    """`h @ (a + b)`: autograd gives `a` and `b` the very same gradient tensor."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(32, 1) * 0.1)
        self.b = nn.Parameter(torch.randn(32, 1) * 0.1)

    def forward(self, hidden):
        return hidden @ (self.a + self.b)


def head_loss(logprobs, values, mask):
    return sft_loss(logprobs, mask) + values.pow(2).mean()


def run_trainer(model, head, num_backwards: int, step: bool = False, optimizer=OptimizerConfig()):
    trainer = Trainer(model)
    trainer.add_base_checkpoint(optimizer=optimizer)
    trainer.add_module_checkpoint("value", head, optimizer=optimizer)
    for seed in range(num_backwards):
        ids, mask = batch(seed=seed)
        out = trainer.forward(ids, mask, outputs=("logprobs", "heads"))
        trainer.backward(head_loss(out.logprobs, out.heads["value"], mask))
    if step:
        trainer.step()
    return trainer


def run_reference(model, head, num_backwards: int):
    for seed in range(num_backwards):
        ids, mask = batch(seed=seed)
        result = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        logprobs = torch.log_softmax(result.logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        head_loss(logprobs, head(result.hidden_states[-1]), mask).backward()


def assert_accumulators_are_private(trainer: Trainer) -> None:
    seen = set()
    for checkpoint in trainer.checkpoints.values():
        for name, param in checkpoint.parameters().items():
            grad = param.grad
            assert grad is not None and grad.is_contiguous() and grad.stride() == param.contiguous().stride(), name
            assert grad.untyped_storage().nbytes() == grad.numel() * grad.element_size(), (
                f"{name}: a view into a larger buffer"
            )
            assert grad.untyped_storage().data_ptr() not in seen, f"{name}: shares its storage"
            seen.add(grad.untyped_storage().data_ptr())


@pytest.mark.parametrize("head_type", [SummedBiasHead, SharedSumHead])
def test_accumulating_twice_matches_plain_autograd(head_type):
    torch.manual_seed(0)
    model, head = tiny_qwen3().train(), head_type()
    reference_model, reference_head = copy.deepcopy(model), copy.deepcopy(head)
    trainer = run_trainer(model, head, num_backwards=2)
    assert_accumulators_are_private(trainer)
    run_reference(reference_model, reference_head, num_backwards=2)
    for p, q in zip(head.parameters(), reference_head.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_clipped_adamw_step_with_shared_gradients_matches_torch_adamw():
    torch.manual_seed(0)
    model, head = tiny_qwen3().train(), SharedSumHead()
    reference_model, reference_head = copy.deepcopy(model), copy.deepcopy(head)
    config = OptimizerConfig(learning_rate=1e-2, grad_clip=0.05)
    run_trainer(model, head, num_backwards=1, step=True, optimizer=config)
    run_reference(reference_model, reference_head, num_backwards=1)
    for module in (reference_model, reference_head):
        torch.nn.utils.clip_grad_norm_(list(module.parameters()), 0.05)
        torch.optim.AdamW(module.parameters(), lr=1e-2, betas=config.betas, eps=config.eps, weight_decay=0.0).step()
    for p, q in zip(head.parameters(), reference_head.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_failure_while_building_accumulators_publishes_none(monkeypatch):
    from trainer_core.training import transaction

    torch.manual_seed(0)
    trainer = run_trainer(tiny_qwen3().train(), SummedBiasHead(), num_backwards=1)
    before = {id(p): (p.grad, p.grad.clone()) for c in trainer.checkpoints.values() for p in c.parameters().values()}
    ids, mask = batch(seed=5)
    out = trainer.forward(ids, mask, outputs=("logprobs", "heads"))
    real, calls = transaction.new_accumulator, []

    def fail_on_the_tenth(*args):
        calls.append(1)
        if len(calls) == 10:
            raise MemoryError("out of memory building an accumulator")
        return real(*args)

    monkeypatch.setattr(transaction, "new_accumulator", fail_on_the_tenth)
    with pytest.raises(MemoryError):
        trainer.backward(head_loss(out.logprobs, out.heads["value"], mask))
    assert len(calls) == 10
    for checkpoint in trainer.checkpoints.values():
        for param in checkpoint.parameters().values():
            accumulator, values = before[id(param)]
            assert param.grad is accumulator and torch.equal(param.grad, values)
