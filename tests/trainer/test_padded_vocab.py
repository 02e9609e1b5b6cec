"""A padded vocabulary never leaks: no gradient or update reaches the padding rows, exports carry the true vocabulary.

The reference is the same model unpadded, trained by the trainer too (whose
gradients the other tests tie to plain autograd): the padded model's outputs,
gradients and weights over the true vocabulary must match it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.trainer.models import batch, tiny_qwen3
from tests.trainer.test_backward_state import MODES, sft_loss
from trainer_core.training import OptimizerConfig, Trainer, export_checkpoint_module, pad_vocabulary

VOCAB = 97
OPTIMIZER = OptimizerConfig(learning_rate=1e-2, weight_decay=0.1)


def padded_and_reference(multiple: int = 64):
    reference_model = tiny_qwen3(vocab=VOCAB).train()
    padded_model = copy.deepcopy(reference_model)
    true_size = pad_vocabulary(padded_model, multiple)
    assert true_size == VOCAB and padded_model.get_input_embeddings().weight.shape[0] == 128
    padded = Trainer(padded_model, vocab_size=true_size)
    reference = Trainer(reference_model)
    for trainer in (padded, reference):
        trainer.add_base_checkpoint(optimizer=OPTIMIZER)
    return padded, reference


def per_token(model) -> dict[str, torch.Tensor]:
    return {"embed": model.get_input_embeddings().weight, "lm_head": model.get_output_embeddings().weight}


@pytest.mark.parametrize("mode", MODES)
def test_padding_rows_get_no_gradient_and_no_update_and_the_true_rows_train_as_unpadded(mode):
    padded, reference = padded_and_reference()
    before = {name: p.detach()[VOCAB:].clone() for name, p in per_token(padded.model).items()}
    assert all(bool((rows == 0).all()) for rows in before.values())
    for step in range(3):
        ids, mask = batch(seed=step, vocab=VOCAB)
        outs = {}
        for name, trainer in (("padded", padded), ("reference", reference)):
            outs[name] = trainer.forward(ids, mask, outputs=("logprobs", "logits", "topk"), top_k=5, mode=mode)
            trainer.backward(sft_loss(outs[name].logprobs, mask) + 0.1 * outs[name].topk_logprobs.mean())
        assert outs["padded"].logits.shape[-1] == VOCAB
        torch.testing.assert_close(outs["padded"].logits, outs["reference"].logits, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(outs["padded"].logprobs, outs["reference"].logprobs, rtol=1e-5, atol=1e-6)
        assert torch.equal(outs["padded"].topk_ids, outs["reference"].topk_ids)
        grads = {name: p.grad for name, p in per_token(padded.model).items()}
        assert all(bool((g[VOCAB:] == 0).all()) for g in grads.values())
        for name, p in per_token(reference.model).items():
            torch.testing.assert_close(grads[name][:VOCAB], p.grad, rtol=1e-5, atol=1e-7)
        padded.step()
        reference.step()
    for name, param in per_token(padded.model).items():
        assert torch.equal(param.detach()[VOCAB:], before[name])  # bitwise: no update, no decay
        state = padded.checkpoints["base"].optimizer.state[param]
        assert bool((state["exp_avg"][VOCAB:] == 0).all()) and bool((state["exp_avg_sq"][VOCAB:] == 0).all())
    for (name, p), q in zip(padded.model.named_parameters(), reference.model.parameters()):
        expected = q.detach()
        torch.testing.assert_close(p.detach()[: expected.shape[0]], expected, rtol=1e-5, atol=1e-6, msg=name)


def test_the_export_carries_the_true_vocabulary(tmp_path):
    padded, reference = padded_and_reference()
    ids, mask = batch(seed=4, vocab=VOCAB)
    padded.backward(sft_loss(padded.forward(ids, mask).logprobs, mask))
    padded.step()
    export_checkpoint_module(padded, "base", tmp_path / "model")
    tensors = load_file(str(tmp_path / "model" / "model.safetensors"))
    assert tensors["model.embed_tokens.weight"].shape[0] == VOCAB and tensors["lm_head.weight"].shape[0] == VOCAB
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model")).eval()
    assert loaded.config.vocab_size == VOCAB
    assert padded.model.config.vocab_size == 128  # the training model keeps its padding
    padded.model.eval()
    with torch.no_grad():
        expected = padded.forward(ids, mask, outputs=("logits",)).logits
        actual = loaded(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def test_a_vocabulary_already_on_the_multiple_is_left_alone():
    model = tiny_qwen3(vocab=128)
    weight = model.get_input_embeddings().weight
    assert pad_vocabulary(model, 64) == 128 and model.get_input_embeddings().weight is weight
    with pytest.raises(ValueError, match="choose a positive multiple"):
        pad_vocabulary(model, 0)
