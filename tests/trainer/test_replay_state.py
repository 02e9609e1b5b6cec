"""A replay runs again what the forward ran: with grad whatever the caller's grad mode, on the module state the
forward read, and it must reproduce the recorded outputs bitwise — or raise, naming the graph.

References are plain autograd on deep copies of the model, fed the same forwards in the same order.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from tests.trainer.models import batch, tiny_qwen3
from tests.trainer.test_backward_state import assert_same_grads, reference_logprobs, sft_loss
from trainer_core.training import Trainer

MODES = ["retain", "offload", "replay"]


def base_trainer(model) -> Trainer:
    trainer = Trainer(model)
    trainer.add_base_checkpoint()
    return trainer


@pytest.mark.parametrize("mode", MODES)
def test_backward_under_no_grad_gives_plain_autograds_gradient(mode):
    ids, mask = batch(seed=2)
    model = tiny_qwen3(dropout=0.2).train()
    reference = copy.deepcopy(model)
    trainer = base_trainer(model)
    torch.manual_seed(4)
    out = trainer.forward(ids, mask, mode=mode)
    loss = sft_loss(out.logprobs, mask)
    with torch.no_grad():
        report = trainer.backward(loss)
    assert report.num_gradients == len(list(model.parameters()))
    torch.manual_seed(4)
    sft_loss(reference_logprobs(reference, ids, mask), mask).backward()
    assert_same_grads(model, reference)


@pytest.mark.parametrize("mode", MODES)
def test_a_graph_whose_used_outputs_reach_no_trainable_parameter_is_an_error(mode):
    """Plain autograd refuses such a loss ("does not require grad"); the trainer must not commit an empty gradient."""
    model = tiny_qwen3().train()
    for param in model.parameters():
        param.requires_grad_(False)
    trainer = Trainer(model)
    head = torch.nn.Linear(32, 1)
    trainer.add_module_checkpoint("value", head)
    ids, mask = batch(seed=3)
    out = trainer.forward(ids, mask, outputs=("logprobs", "heads"), mode=mode)
    with pytest.raises(RuntimeError, match=rf"graph {out.graph_id}: .*logprobs.* reach no trainable parameter"):
        trainer.backward(sft_loss(out.logprobs, mask))
    assert head.weight.grad is None


# -- module state: dynamic RoPE recomputes the rotary `inv_freq` buffer when a longer row comes -----------------------


def dynamic_rope_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=16,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "eager"
    return model.train()


def exact_logprobs(model, ids, mask):
    """The trainer's own formula (fused cross-entropy in float32), so that bitwise equality is the bar."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    return -F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1), reduction="none"
    ).view(ids.shape[0], -1)


@pytest.mark.parametrize("mode", MODES)
def test_dynamic_rope_replay_after_a_longer_forward_is_bitwise_plain_autograd(mode):
    model = dynamic_rope_llama()
    reference = copy.deepcopy(model)
    trainer = base_trainer(model)
    (ids_a, mask_a), (ids_b, mask_b) = batch(seed=1, length=24), batch(seed=2, length=40)
    out_a = trainer.forward(ids_a, mask_a, mode=mode)  # 24 > 16 positions: inv_freq is recomputed for 24
    out_b = trainer.forward(ids_b, mask_b, mode=mode)  # and again for 40
    trainer.backward(sft_loss(out_a.logprobs, mask_a))

    loss_a = sft_loss(exact_logprobs(reference, ids_a, mask_a), mask_a)
    exact_logprobs(reference, ids_b, mask_b)
    loss_a.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    # The caller's module state is what the two forwards left, not what the replay saw.
    rotary, expected = model.model.rotary_emb, reference.model.rotary_emb
    assert rotary.max_seq_len_cached == expected.max_seq_len_cached == 40
    assert torch.equal(rotary.inv_freq, expected.inv_freq)
    del out_b


def test_a_replay_leaves_the_callers_module_state_as_it_found_it():
    """A(24), C(8) resets the rotary state, backward of A replays a 24-row forward: a later D(20) must still see
    what C left (plain autograd never reruns A), not the state A's rerun would leave."""
    model = dynamic_rope_llama()
    reference = copy.deepcopy(model)
    trainer = base_trainer(model)
    (ids_a, mask_a), (ids_c, mask_c), (ids_d, mask_d) = (batch(seed=s, length=n) for s, n in ((1, 24), (2, 8), (3, 20)))
    out_a = trainer.forward(ids_a, mask_a, mode="replay")
    trainer.forward(ids_c, mask_c, mode="replay")
    trainer.backward(sft_loss(out_a.logprobs, mask_a))
    out_d = trainer.forward(ids_d, mask_d, mode="retain")
    with torch.no_grad():
        exact_logprobs(reference, ids_a, mask_a)
        exact_logprobs(reference, ids_c, mask_c)
        expected_d = exact_logprobs(reference, ids_d, mask_d)
    assert torch.equal(out_d.logprobs.detach(), expected_d)


# -- the guard: a replay that computes something else than its forward raises --------------------------------------


@pytest.mark.parametrize("outputs", [("logprobs",), ("topk",), ("hidden",)])
def test_a_replay_that_does_not_reproduce_its_forward_raises_naming_the_graph(outputs):
    model = tiny_qwen3().train()
    trainer = base_trainer(model)
    ids, mask = batch(seed=5)
    trainer.forward(ids, mask, mode="replay")  # another graph: the error names the right one
    out = trainer.forward(ids, mask, outputs=outputs, top_k=3, mode="replay")
    with torch.no_grad():
        model.model.rotary_emb.inv_freq.mul_(1.001)  # module state the replay cannot restore (changed in place)
    used = {"logprobs": out.logprobs, "topk": out.topk_logprobs, "hidden": out.hidden_states}[outputs[0]]
    with pytest.raises(RuntimeError, match=rf"graph {out.graph_id}: the replay .* not reproduce .*{outputs[0]}"):
        trainer.backward(used.float().mean())
    assert all(p.grad is None for p in model.parameters())
