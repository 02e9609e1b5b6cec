"""A base checkpoint and a LoRA checkpoint together: both train, exactly as plain autograd on a peft model.

Parameters are owned by identity: peft's wrapping (`q_proj` → `lora.Linear`
with `base_layer`) renames the base weights but they stay the base
checkpoint's, and the weight swap before a step lands where the forward reads.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model

from tests.trainer.models import batch, tiny_qwen3
from tests.trainer.test_backward_state import reference_logprobs, sft_loss
from trainer_core.training import OptimizerConfig, Trainer

LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
BASE_OPTIMIZER = OptimizerConfig(learning_rate=1e-2, weight_decay=0.01, grad_clip=0.5)
LORA_OPTIMIZER = OptimizerConfig(learning_rate=3e-2, grad_clip=0.0)


def base_and_lora():
    model = tiny_qwen3().train()
    reference = copy.deepcopy(model)
    trainer = Trainer(model)
    trainer.add_base_checkpoint(optimizer=BASE_OPTIMIZER)
    torch.manual_seed(7)
    trainer.add_lora_checkpoint("adapter", LORA, optimizer=LORA_OPTIMIZER)
    torch.manual_seed(7)
    inject_adapter_in_model(LORA, reference, adapter_name="adapter")
    reference.requires_grad_(True)  # the reference trains everything: base and adapter
    return trainer, reference


def adamw(params, config):
    return torch.optim.AdamW(
        params, lr=config.learning_rate, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay
    )


def test_registration_keeps_the_base_trainable_and_ownership_by_identity():
    trainer, reference = base_and_lora()
    base, adapter = trainer.checkpoints["base"], trainer.checkpoints["adapter"]
    q_proj = trainer.model.model.layers[0].self_attn.q_proj
    assert any(p is q_proj.base_layer.weight for p in base.parameters().values())
    assert all(p.requires_grad for p in base.parameters().values())
    lora_params = {id(p) for n, p in trainer.model.named_parameters() if "lora_" in n}
    assert {id(p) for p in adapter.parameters().values()} == lora_params
    assert not lora_params & {id(p) for p in base.parameters().values()}


@pytest.mark.parametrize("hold_a_graph_across_steps", [False, True])
def test_base_and_lora_train_as_plain_autograd_on_a_peft_model(hold_a_graph_across_steps):
    trainer, reference = base_and_lora()
    names = [n for n, _ in reference.named_parameters()]
    reference_base = [p for n, p in reference.named_parameters() if "lora_" not in n]
    reference_lora = [p for n, p in reference.named_parameters() if "lora_" in n]
    optimizers = [
        (reference_base, adamw(reference_base, BASE_OPTIMIZER), BASE_OPTIMIZER.grad_clip),
        (reference_lora, adamw(reference_lora, LORA_OPTIMIZER), LORA_OPTIMIZER.grad_clip),
    ]
    held = None
    for step in range(3):
        ids, mask = batch(seed=step)
        out = trainer.forward(ids, mask)
        trainer.backward(sft_loss(out.logprobs, mask))
        if hold_a_graph_across_steps:  # a live graph makes the step hand its weights over (snapshot)
            held = trainer.forward(ids, mask)
        reports = trainer.step()
        assert reports["base"].stepped and reports["adapter"].stepped
        sft_loss(reference_logprobs(reference, ids, mask), mask).backward()
        for params, optimizer, clip in optimizers:
            if clip:
                torch.nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    del held
    live = dict(trainer.model.named_parameters())
    assert sorted(live) == sorted(names)
    for name, expected in reference.named_parameters():
        torch.testing.assert_close(live[name], expected, rtol=1e-5, atol=1e-6, msg=name)
    ids, mask = batch(seed=9)
    with torch.no_grad():  # the forward reads the stepped weights
        torch.testing.assert_close(
            trainer.model(input_ids=ids, attention_mask=mask).logits,
            reference(input_ids=ids, attention_mask=mask).logits,
            rtol=1e-5,
            atol=1e-5,
        )


@pytest.mark.parametrize("mode", ["retain", "replay"])
def test_a_stale_graph_of_base_and_lora_gets_the_gradient_at_its_weights(mode):
    trainer, reference = base_and_lora()
    ids, mask = batch(seed=1)
    stale = trainer.forward(ids, mask, mode=mode)
    at_forward = copy.deepcopy(reference)
    other = trainer.forward(*batch(seed=2))
    trainer.backward(sft_loss(other.logprobs, batch(seed=2)[1]))
    trainer.step()
    trainer.zero_grad()
    trainer.backward(sft_loss(stale.logprobs, mask))
    sft_loss(reference_logprobs(at_forward, ids, mask), mask).backward()
    expected = dict(at_forward.named_parameters())
    for name, param in trainer.model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name].grad, rtol=1e-5, atol=1e-7, msg=name)


def test_lora_before_base_is_refused():
    trainer = Trainer(tiny_qwen3().train())
    trainer.add_lora_checkpoint("adapter", LORA)
    with pytest.raises(ValueError, match="register the base checkpoint before"):
        trainer.add_base_checkpoint()


def test_a_parameter_trains_in_one_checkpoint_only():
    trainer = Trainer(tiny_qwen3().train())
    trainer.add_base_checkpoint()
    with pytest.raises(ValueError, match=r"already belongs to checkpoint 'base' \(as lm_head.weight\)"):
        trainer.add_module_checkpoint("head", trainer.model.lm_head)
    assert "head" not in trainer.heads and "head" not in trainer.checkpoints
