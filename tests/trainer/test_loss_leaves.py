"""What a loss may depend on: this trainer's managed outputs and parameters its checkpoints own.

Outputs of another trainer, or a tensor that requires grad but that no
checkpoint owns, are refused with a clear error rather than silently dropped
or mis-routed; `gradient=` and `retain_graph=True` behave as in
`torch.Tensor.backward`. References: plain autograd on deep copies.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.trainer.models import batch, tiny_qwen3
from tests.trainer.test_backward_state import assert_same_grads, reference_logprobs, sft_loss
from trainer_core.training import Trainer


def base_trainer(seed: int = 0) -> Trainer:
    trainer = Trainer(tiny_qwen3(seed).train())
    trainer.add_base_checkpoint()
    return trainer


@pytest.mark.parametrize("order", ["policy_first", "critic_first"])
def test_a_loss_over_two_trainers_outputs_is_refused(order):
    policy, critic = base_trainer(0), base_trainer(1)
    ids, mask = batch()
    policy_out, critic_out = policy.forward(ids, mask), critic.forward(ids, mask)
    terms = [sft_loss(policy_out.logprobs, mask), critic_out.logprobs.mean()]
    loss = terms[0] + terms[1] if order == "policy_first" else terms[1] + terms[0]
    with pytest.raises(ValueError, match="another Trainer"):
        policy.backward(loss)
    assert all(p.grad is None for p in policy.model.parameters())
    assert all(p.grad is None for p in critic.model.parameters())
    # Each trainer differentiates its own part exactly.
    reference = copy.deepcopy(policy.model)
    policy.backward(terms[0])
    sft_loss(reference_logprobs(reference, ids, mask), mask).backward()
    assert_same_grads(policy.model, reference)


def test_a_tensor_no_checkpoint_owns_is_refused():
    trainer = base_trainer()
    ids, mask = batch()
    out = trainer.forward(ids, mask)
    temperature = torch.nn.Parameter(torch.ones(()))
    with pytest.raises(ValueError, match="no checkpoint owns"):
        trainer.backward(sft_loss(out.logprobs / temperature, mask))
    assert all(p.grad is None for p in trainer.model.parameters())


def test_a_checkpoint_parameter_used_directly_in_the_loss_gets_its_gradient():
    trainer = Trainer(tiny_qwen3().train())
    trainer.add_base_checkpoint()
    head = torch.nn.Linear(32, 1)
    trainer.add_module_checkpoint("value", head)
    reference_model, reference_head = copy.deepcopy(trainer.model), copy.deepcopy(head)
    ids, mask = batch()
    out = trainer.forward(ids, mask, outputs=("logprobs", "hidden"))
    trainer.backward(sft_loss(out.logprobs, mask) + head(out.hidden_states).pow(2).mean() + head.weight.pow(2).sum())
    result = reference_model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    logprobs = torch.log_softmax(result.logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (
        sft_loss(logprobs, mask)
        + reference_head(result.hidden_states[-1]).pow(2).mean()
        + reference_head.weight.pow(2).sum()
    ).backward()
    assert_same_grads(trainer.model, reference_model)
    assert_same_grads(head, reference_head)


@pytest.mark.parametrize("mode", ["retain", "offload", "replay"])
def test_retain_graph_keeps_the_loss_graph_too(mode):
    trainer = base_trainer()
    reference = copy.deepcopy(trainer.model)
    ids, mask = batch()
    out = trainer.forward(ids, mask, mode=mode)
    loss = sft_loss(out.logprobs, mask)
    trainer.backward(loss, retain_graph=True)
    trainer.backward(loss)  # as loss.backward(retain_graph=True) then loss.backward()
    reference_loss = sft_loss(reference_logprobs(reference, ids, mask), mask)
    reference_loss.backward(retain_graph=True)
    reference_loss.backward()
    assert_same_grads(trainer.model, reference)


def test_a_non_scalar_loss_takes_a_gradient():
    trainer = base_trainer()
    reference = copy.deepcopy(trainer.model)
    ids, mask = batch()
    weights = torch.rand(ids.shape[0], ids.shape[1] - 1, generator=torch.Generator().manual_seed(3))
    out = trainer.forward(ids, mask)
    trainer.backward(out.logprobs, gradient=weights)
    reference_logprobs(reference, ids, mask).backward(weights)
    assert_same_grads(trainer.model, reference)
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
        trainer.backward(trainer.forward(ids, mask).logprobs)
