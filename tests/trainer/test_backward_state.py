"""Retain, offload and replay give plain autograd's gradient for a fresh graph."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig

from tests.trainer.models import batch, tiny_qwen3
from trainer_core.training import Trainer

MODES = ["retain", "offload", "replay"]


def sft_loss(logprobs: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    mask = attention_mask[:, 1:].to(logprobs.dtype)
    return -(logprobs * mask).sum() / mask.sum()


def reference_logprobs(model, input_ids, attention_mask):
    """Plain autograd's token logprobs, in float32 or wider (a float64 model stays float64)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def assert_same_grads(trained, reference) -> None:
    pairs = [(n, p, q) for (n, p), q in zip(trained.named_parameters(), reference.parameters()) if p.requires_grad]
    assert pairs
    for name, p, q in pairs:
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("mode", MODES)
def test_full_model_matches_plain_autograd(mode, dropout):
    input_ids, attention_mask = batch()
    model = tiny_qwen3(dropout=dropout).train()
    reference = copy.deepcopy(model)
    trainer = Trainer(model)
    trainer.add_base_checkpoint()
    torch.manual_seed(5)
    out = trainer.forward(input_ids, attention_mask, mode=mode)
    torch.manual_seed(1234)  # the RNG moves on between forward and backward, as in real use
    trainer.backward(sft_loss(out.logprobs, attention_mask))
    torch.manual_seed(5)
    sft_loss(reference_logprobs(reference, input_ids, attention_mask), attention_mask).backward()
    assert_same_grads(model, reference)


@pytest.mark.parametrize("mode", MODES)
def test_lora_adapter_and_value_head_match_plain_autograd(mode):
    input_ids, attention_mask = batch()
    model = tiny_qwen3(dropout=0.2).train()
    trainer = Trainer(model)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1, init_lora_weights=False)
    trainer.add_lora_checkpoint("adapter", lora)
    torch.manual_seed(3)
    head = torch.nn.Linear(32, 1)
    trainer.add_module_checkpoint("value", head)
    reference_model, reference_head = copy.deepcopy(model), copy.deepcopy(head)
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)

    def loss_of(logprobs, values):
        return sft_loss(logprobs, attention_mask) + 0.5 * (values.squeeze(-1) ** 2).mean()

    torch.manual_seed(9)
    out = trainer.forward(input_ids, attention_mask, outputs=("logprobs", "heads"), mode=mode)
    trainer.backward(loss_of(out.logprobs, out.heads["value"]))

    torch.manual_seed(9)
    result = reference_model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    logprobs = torch.log_softmax(result.logits[:, :-1].float(), -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    loss_of(logprobs, reference_head(result.hidden_states[-1])).backward()
    assert_same_grads(model, reference_model)
    assert_same_grads(head, reference_head)


def test_replay_keeps_a_fraction_of_retains_saved_bytes():
    input_ids, attention_mask = batch(size=4, length=32)
    model = tiny_qwen3().train()
    trainer = Trainer(model)
    trainer.add_base_checkpoint()
    kept = {}
    for mode in MODES:
        out = trainer.forward(input_ids, attention_mask, mode=mode)
        kept[mode] = trainer.graphs.resident_saved_bytes()
        del out
    assert kept["replay"] < 0.1 * kept["retain"] and kept["offload"] == 0 < kept["retain"]


@pytest.mark.parametrize("mode", MODES)
def test_topk_logits_and_hidden_outputs_match_plain_autograd(mode):
    input_ids, attention_mask = batch()
    model = tiny_qwen3(dropout=0.1).train()
    reference = copy.deepcopy(model)
    trainer = Trainer(model)
    trainer.add_base_checkpoint()

    def loss_of(topk, logits, hidden):
        return topk.exp().sum() * 1e-2 + logits.pow(2).mean() * 1e-3 + hidden.tanh().mean()

    torch.manual_seed(11)
    out = trainer.forward(input_ids, attention_mask, outputs=("topk", "logits", "hidden"), top_k=3, mode=mode)
    assert out.topk_logprobs.shape == (3, 11, 3) and out.topk_ids.shape == (3, 11, 3) and out.logprobs is None
    trainer.backward(loss_of(out.topk_logprobs, out.logits, out.hidden_states))
    torch.manual_seed(11)
    result = reference(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    values, ids = torch.log_softmax(result.logits[:, :-1], -1).topk(3, dim=-1)
    assert torch.equal(ids, out.topk_ids)
    loss_of(values, result.logits, result.hidden_states[-1]).backward()
    assert_same_grads(model, reference)
