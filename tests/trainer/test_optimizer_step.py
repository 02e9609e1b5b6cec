"""The optimizer step: norms of every selected checkpoint first, then all step or none; FP32 masters.

References: torch.optim.AdamW on copies (an FP32 master copy for a bf16 model).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.trainer.models import DEVICES, batch, tiny_qwen3
from tests.trainer.test_backward_state import sft_loss
from trainer_core.training import OptimizerConfig, Trainer


class DetachedHead(nn.Module):
    """A value head on the detached hidden state: its loss term reaches the head only."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 1)

    def forward(self, hidden):
        return self.proj(hidden.detach())


def test_a_non_finite_norm_in_one_checkpoint_steps_none():
    trainer = Trainer(tiny_qwen3().train(), nonfinite="skip")
    trainer.add_base_checkpoint()
    trainer.add_module_checkpoint("value", DetachedHead())
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    ids, mask = batch()
    out = trainer.forward(ids, mask, outputs=("logprobs", "heads"))
    trainer.backward(sft_loss(out.logprobs, mask) + out.heads["value"].sum() * float("nan"))
    assert all(torch.isfinite(p.grad).all() for p in trainer.model.parameters())  # the base's own norm is finite
    reports = trainer.step()
    assert not reports["base"].stepped and not reports["value"].stepped
    assert "value" in reports["base"].skipped_reason and "non-finite" in reports["base"].skipped_reason
    assert all(c.revision == 0 for c in trainer.checkpoints.values())
    assert all(torch.equal(p, weights[n]) for n, p in trainer.model.named_parameters())
    assert all(p.grad is None for c in trainer.checkpoints.values() for p in c.parameters().values())


def _plain_bf16_step(model, masters, optimizer, ids, mask, clip):
    logits = model(input_ids=ids, attention_mask=mask).logits
    vocab = logits.shape[-1]
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), ids[:, 1:].reshape(-1), reduction="none")
    sft_loss(-nll.view(ids.shape[0], -1), mask).backward()
    for master, param in zip(masters, model.parameters()):
        master.grad = param.grad.float()
        param.grad = None
    torch.nn.utils.clip_grad_norm_(masters, clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for master, param in zip(masters, model.parameters()):
            param.copy_(master)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_parameters_train_through_fp32_masters_as_adamw_on_an_fp32_copy(device):
    config = OptimizerConfig(learning_rate=1e-4, weight_decay=0.01, grad_clip=1.0)
    model = tiny_qwen3(dtype=torch.bfloat16).train().to(device)
    initial = [p.detach().clone() for p in model.parameters()]
    reference = copy.deepcopy(model)
    masters = [p.detach().float().clone().requires_grad_() for p in reference.parameters()]
    optimizer = torch.optim.AdamW(
        masters, lr=config.learning_rate, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay
    )
    trainer = Trainer(model)
    trainer.add_base_checkpoint(optimizer=config)
    for step in range(20):
        ids, mask = (t.to(device) for t in batch(seed=step))
        out = trainer.forward(ids, mask)
        trainer.backward(sft_loss(out.logprobs, mask))
        assert trainer.step()["base"].stepped
        _plain_bf16_step(reference, masters, optimizer, ids, mask, config.grad_clip)
    kept = trainer.checkpoints["base"].master_weights()
    # Bitwise on the CPU; CUDA's embedding backward accumulates with atomics, in a varying order.
    exact = {"rtol": 0, "atol": 0} if device == "cpu" else {"rtol": 1e-2, "atol": 1e-5}
    for (name, p), q, master, start in zip(model.named_parameters(), reference.parameters(), masters, initial):
        assert p.dtype == torch.bfloat16 and kept[name].dtype == torch.float32 and kept[name].device == p.device
        torch.testing.assert_close(p, q, msg=name, **exact)
        torch.testing.assert_close(kept[name], master.detach(), msg=name, **exact)
        assert not torch.equal(kept[name], start.float()), f"{name}: the master did not move"
        # Norm weights sit at 1.0, where bf16's step (2^-7) is wider than 20 updates of 1e-4; every
        # other parameter must have moved in bf16 too.
        assert "norm" in name or not torch.equal(p, start), (
            f"{name}: a bf16 parameter did not move in 20 steps at lr 1e-4"
        )


def test_a_checkpoint_without_gradient_does_not_step_and_missing_parameters_are_skipped():
    config = OptimizerConfig(learning_rate=1e-2, weight_decay=0.1, grad_clip=0.0)
    model, head = tiny_qwen3().train(), DetachedHead()
    reference_model, reference_head = copy.deepcopy(model), copy.deepcopy(head)
    trainer = Trainer(model)
    trainer.add_base_checkpoint(optimizer=config)
    trainer.add_module_checkpoint("value", head, optimizer=config)
    reference_optimizer = torch.optim.AdamW(
        reference_head.parameters(), lr=1e-2, betas=config.betas, eps=config.eps, weight_decay=0.1
    )
    ids, mask = batch()
    out = trainer.forward(ids, mask, outputs=("logprobs", "heads"))
    trainer.backward(sft_loss(out.logprobs, mask) + out.heads["value"].pow(2).mean())
    trainer.step()
    hidden = reference_model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    reference_head(hidden).pow(2).mean().backward()
    reference_optimizer.step()
    reference_optimizer.zero_grad(set_to_none=True)
    head_after_one = [p.detach().clone() for p in head.parameters()]
    # Step 2: only the base has a gradient; the head has momentum and weight decay but must not move.
    out = trainer.forward(ids, mask)
    trainer.backward(sft_loss(out.logprobs, mask))
    reports = trainer.step()
    assert reports["base"].stepped and not reports["value"].stepped and reports["value"].skipped_reason == "no gradient"
    assert trainer.checkpoints["value"].revision == 1
    assert all(torch.equal(p, q) for p, q in zip(head.parameters(), head_after_one))
    # Step 3: only the bias has a gradient; AdamW leaves the weight alone, as torch's does.
    out = trainer.forward(ids, mask)
    trainer.backward(sft_loss(out.logprobs, mask) + head.proj.bias.sum())
    assert head.proj.weight.grad is None
    assert trainer.step()["value"].stepped
    reference_head.proj.bias.sum().backward()
    reference_optimizer.step()
    for p, q in zip(head.parameters(), reference_head.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
