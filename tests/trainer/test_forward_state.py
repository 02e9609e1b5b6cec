"""What a forward saw is what backward differentiates: reused input buffers, parameters changed in place, module modes.

The reference is plain autograd on a deep copy of the model, which either
differentiates the values its forward saw or raises PyTorch's own
"modified by an inplace operation" error; every backward mode must do one or
the other, never differentiate something else.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.trainer.models import batch, tiny_qwen3
from tests.trainer.test_backward_state import MODES, assert_same_grads, reference_logprobs, sft_loss
from trainer_core.training import Trainer


def fresh_trainer(dropout: float = 0.0) -> Trainer:
    trainer = Trainer(tiny_qwen3(dropout=dropout).train())
    trainer.add_base_checkpoint()
    return trainer


@pytest.mark.parametrize("mode", MODES)
def test_a_reused_input_buffer_gives_the_forwards_gradient_or_pytorchs_error(mode):
    input_ids, attention_mask = batch()
    trainer = fresh_trainer()
    reference = copy.deepcopy(trainer.model)
    buffer, mask_buffer = input_ids.clone(), attention_mask.clone()
    out = trainer.forward(buffer, mask_buffer, mode=mode)
    loss = sft_loss(out.logprobs, attention_mask)
    buffer.copy_(batch(seed=2)[0])  # a preallocated batch buffer refilled before backward
    mask_buffer.fill_(1)
    if mode == "retain":  # autograd saved the buffer itself: PyTorch's own error, as plain autograd gives
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            trainer.backward(loss)
        return
    trainer.backward(loss)  # offload and replay keep what the forward saw
    sft_loss(reference_logprobs(reference, input_ids, attention_mask), attention_mask).backward()
    assert_same_grads(trainer.model, reference)


@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_changed_in_place_before_backward_raises_pytorchs_error(mode):
    input_ids, attention_mask = batch()
    trainer = fresh_trainer()
    out = trainer.forward(input_ids, attention_mask, mode=mode)
    with torch.no_grad():  # e.g. a caller's EMA or manual decay
        trainer.model.model.layers[0].self_attn.q_proj.weight.mul_(0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        trainer.backward(sft_loss(out.logprobs, attention_mask))
    assert all(p.grad is None for p in trainer.model.parameters())


def test_plain_autograd_raises_the_same_error_for_that_change():
    """The reference behaviour the test above holds every mode to."""
    input_ids, attention_mask = batch()
    model = tiny_qwen3().train()
    loss = sft_loss(reference_logprobs(model, input_ids, attention_mask), attention_mask)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("mode", MODES)
def test_backward_after_switching_to_eval_differentiates_the_train_mode_forward(mode):
    input_ids, attention_mask = batch()
    trainer = fresh_trainer(dropout=0.3)
    reference = copy.deepcopy(trainer.model)
    torch.manual_seed(21)
    out = trainer.forward(input_ids, attention_mask, mode=mode)
    trainer.model.eval()  # as RL loops do before sampling
    trainer.backward(sft_loss(out.logprobs, attention_mask))
    assert not any(m.training for m in trainer.model.modules()), "backward changed the caller's module modes"
    torch.manual_seed(21)
    sft_loss(reference_logprobs(reference, input_ids, attention_mask), attention_mask).backward()
    assert_same_grads(trainer.model, reference)


def test_replay_restores_per_module_flags():
    input_ids, attention_mask = batch()
    trainer = fresh_trainer(dropout=0.3)
    trainer.model.model.layers[1].eval()  # a mixed configuration: one layer without dropout
    reference = copy.deepcopy(trainer.model)
    torch.manual_seed(4)
    out = trainer.forward(input_ids, attention_mask, mode="replay")
    trainer.model.train()
    trainer.backward(sft_loss(out.logprobs, attention_mask))
    assert trainer.model.model.layers[1].training  # the caller's flags are back after the replay
    torch.manual_seed(4)
    sft_loss(reference_logprobs(reference, input_ids, attention_mask), attention_mask).backward()
    assert_same_grads(trainer.model, reference)
