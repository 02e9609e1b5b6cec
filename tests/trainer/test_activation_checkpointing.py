"""Block activation checkpointing: bitwise the gradients of a plain forward, in every mode, stale or not; fewer bytes.

References: the same Trainer without checkpointing (bitwise), and plain autograd on a deep copy of the model.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.trainer.models import batch, tiny_qwen3
from tests.trainer.test_backward_state import assert_same_grads, reference_logprobs, sft_loss
from trainer_core.training import MemoryPlanner, OptimizerConfig, StalenessPolicy, Trainer
from trainer_core.training.activation_checkpointing import checkpoint_blocks, decoder_layers, is_checkpointed
from trainer_core.training.memory.retained import RetainedGraph, saved_tensor_bytes

MODES = ["retain", "offload", "replay"]
OPTIMIZER = OptimizerConfig(learning_rate=1e-2, grad_clip=0.0)


def pair(dropout: float = 0.1, **trainer_kwargs) -> tuple[Trainer, Trainer]:
    """The same model in two trainers: without and with block checkpointing."""
    model = tiny_qwen3(dropout=dropout).train()
    checkpointed = copy.deepcopy(model)
    assert checkpoint_blocks(checkpointed) == 2
    trainers = []
    for m in (model, checkpointed):
        trainer = Trainer(m, **trainer_kwargs)
        trainer.add_base_checkpoint(optimizer=OPTIMIZER)
        trainers.append(trainer)
    return trainers[0], trainers[1]


def grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in trainer.model.named_parameters() if p.grad is not None}


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name


def seeded_forward(trainer: Trainer, ids, mask, mode: str, seed: int = 7):
    torch.manual_seed(seed)  # the same dropout draws in both trainers
    return trainer.forward(ids, mask, mode=mode)


def test_names_state_dict_and_eval_outputs_are_those_of_the_plain_model():
    model = tiny_qwen3().eval()
    checkpointed = copy.deepcopy(model)
    checkpoint_blocks(checkpointed)
    checkpoint_blocks(checkpointed)  # idempotent: a layer is checkpointed once
    assert is_checkpointed(checkpointed) and not is_checkpointed(model)
    assert [n for n, _ in checkpointed.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert list(checkpointed.state_dict()) == list(model.state_dict())
    ids, mask = batch()
    with torch.no_grad():
        assert torch.equal(checkpointed(input_ids=ids, attention_mask=mask).logits, model(ids, mask).logits)


def test_a_model_without_decoder_layers_is_refused_with_the_key_to_change():
    with pytest.raises(ValueError, match='activation_checkpointing = "blocks" needs one'):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_gives_bitwise_the_gradients_without_checkpointing_with_dropout(mode):
    plain, checkpointed = pair(dropout=0.1)
    reference = copy.deepcopy(plain.model)
    ids, mask = batch()
    for trainer in (plain, checkpointed):
        out = seeded_forward(trainer, ids, mask, mode)
        trainer.backward(sft_loss(out.logprobs, mask))
    assert_bitwise(grads(plain), grads(checkpointed))
    torch.manual_seed(7)
    sft_loss(reference_logprobs(reference, ids, mask), mask).backward()
    assert_same_grads(checkpointed.model, reference)


def test_plain_autograd_through_checkpointed_layers_is_bitwise_plain_autograd():
    model = tiny_qwen3(dropout=0.1).train()
    checkpointed = copy.deepcopy(model)
    checkpoint_blocks(checkpointed)
    ids, mask = batch()
    for m in (model, checkpointed):
        torch.manual_seed(3)
        sft_loss(reference_logprobs(m, ids, mask), mask).backward()
    for (name, p), q in zip(model.named_parameters(), checkpointed.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("mode", MODES)
def test_a_stale_graph_recomputes_at_its_forward_weights(mode):
    """The recompute in backward must read the weights the forward ran at, not the ones a step gave the model since."""
    plain, checkpointed = pair(dropout=0.1, staleness=StalenessPolicy(max_gradient_staleness=2))
    at_forward = copy.deepcopy(plain.model)
    ids, mask = batch(seed=1)
    held = {}
    for trainer in (plain, checkpointed):
        held[id(trainer)] = seeded_forward(trainer, ids, mask, mode)
        for seed in range(2):  # two steps on other batches
            other_ids, other_mask = batch(seed=100 + seed)
            out = seeded_forward(trainer, other_ids, other_mask, "retain", seed=50 + seed)
            trainer.backward(sft_loss(out.logprobs, other_mask))
            assert trainer.step()["base"].stepped
    for trainer in (plain, checkpointed):
        report = trainer.backward(sft_loss(held[id(trainer)].logprobs, mask))
        assert list(report.ages.values()) == [{"base": 2}]
    assert_bitwise(grads(plain), grads(checkpointed))
    torch.manual_seed(7)
    sft_loss(reference_logprobs(at_forward, ids, mask), mask).backward()
    assert_same_grads(checkpointed.model, at_forward)
    # The live weights moved on: a gradient at them would differ.
    assert any(not torch.equal(p, q) for p, q in zip(checkpointed.model.parameters(), at_forward.parameters()))


def test_a_recompute_runs_in_the_module_state_of_its_forward():
    """Forward in train mode (dropout on), `eval()` before backward: the recompute still drops out as the forward."""
    plain, checkpointed = pair(dropout=0.1)
    ids, mask = batch()
    for trainer in (plain, checkpointed):
        out = seeded_forward(trainer, ids, mask, "retain")
        trainer.model.eval()
        trainer.backward(sft_loss(out.logprobs, mask))
        assert not any(m.training for m in trainer.model.modules())  # the caller's state afterwards
    assert_bitwise(grads(plain), grads(checkpointed))


def test_a_retained_graph_saves_only_the_layers_inputs_and_inspecting_it_recomputes_nothing():
    plain, checkpointed = pair(dropout=0.0)
    ids, mask = batch(size=4, length=32)
    bytes_of = {}
    for trainer in (plain, checkpointed):
        calls = []
        for layer in trainer.model.model.layers:
            layer.self_attn.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        out = trainer.forward(ids, mask, mode="retain")
        graph = trainer.graphs.get(out.graph_id)
        assert graph is not None and isinstance(graph.state, RetainedGraph)
        bytes_of[trainer is checkpointed] = graph.state.saved_bytes
        # Counting again reads no placeholder (reading one would run the layer again): the same bytes, no call.
        assert saved_tensor_bytes(graph.state.outputs, trainer._parameter_storages()) == graph.state.saved_bytes
        assert len(calls) == 2
        trainer.backward(sft_loss(out.logprobs, mask))
        assert len(calls) == (4 if trainer is checkpointed else 2)  # one recompute per layer in backward
    hidden = checkpointed.model.config.hidden_size
    layer_input = ids.numel() * hidden * 4  # one float32 hidden state per token
    # What each checkpointed layer keeps (its input) is counted; all the rest of its activations are not.
    assert bytes_of[True] >= 2 * layer_input
    assert bytes_of[True] < bytes_of[False] / 3


def test_the_planner_budgets_the_smaller_figure():
    """A budget between the two figures: checkpointed graphs are retained, plain ones are not."""
    ids, mask = batch(size=4, length=32)
    measured = {}
    for flag in (False, True):
        trainer = pair(dropout=0.0, planner=MemoryPlanner(budget_bytes=10**12))[flag]
        out = trainer.forward(ids, mask, mode="retain")  # evidence for the shape
        measured[flag] = trainer.graphs.get(out.graph_id).state.saved_bytes  # pyright: ignore[reportOptionalMemberAccess]
    budget = (measured[False] + measured[True]) // 2
    for flag in (False, True):
        trainer = pair(dropout=0.0, planner=MemoryPlanner(budget_bytes=budget))[flag]
        warm = trainer.forward(ids, mask, mode="retain")
        trainer.backward(sft_loss(warm.logprobs, mask))
        out = trainer.forward(ids, mask)
        assert (trainer.graphs.get(out.graph_id).mode == "retain") is flag  # pyright: ignore[reportOptionalMemberAccess]
        assert trainer.peak_saved_bytes <= budget or not flag


def test_a_recompute_runs_the_adapter_of_its_forward():
    """Two LoRA adapters (checkpointing applied first, as a run builds it): forward with `a`, forward with `b`, then
    backward `a`'s graph while `b` is active: the recompute must run `a`."""
    from peft import LoraConfig

    configs = {
        "a": LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1, init_lora_weights=False
        ),
        "b": LoraConfig(r=2, lora_alpha=4, target_modules=["k_proj", "down_proj"], init_lora_weights=False),
    }
    model = tiny_qwen3(dropout=0.1).train()
    trainers = []
    for checkpointed in (False, True):
        m = copy.deepcopy(model)
        if checkpointed:
            checkpoint_blocks(m)
        trainer = Trainer(m)
        for seed, (name, config) in enumerate(configs.items()):
            torch.manual_seed(seed)
            trainer.add_lora_checkpoint(name, config, optimizer=OPTIMIZER)
        trainers.append(trainer)
    ids, mask = batch()
    for trainer in trainers:
        torch.manual_seed(7)
        out_a = trainer.forward(ids, mask, mode="retain", checkpoint="a")
        torch.manual_seed(8)
        out_b = trainer.forward(ids, mask, mode="retain", checkpoint="b")
        trainer.backward(sft_loss(out_a.logprobs, mask))
        trainer.backward(sft_loss(out_b.logprobs, mask))
    assert_bitwise(grads(trainers[0]), grads(trainers[1]))
    assert any("lora_A.a" in name for name in grads(trainers[1])) and any("lora_A.b" in n for n in grads(trainers[1]))


def test_a_deep_copy_of_a_checkpointed_model_runs_its_own_layers():
    model = tiny_qwen3().train()
    checkpoint_blocks(model)
    copied = copy.deepcopy(model)
    assert is_checkpointed(copied)
    with torch.no_grad():
        for p in copied.model.layers.parameters():
            p.mul_(0.5)
    ids, mask = batch()
    plain = tiny_qwen3().train()
    with torch.no_grad():
        for p in plain.model.layers.parameters():
            p.mul_(0.5)
    for m in (copied, plain):
        sft_loss(reference_logprobs(m, ids, mask), mask).backward()
    for (name, p), q in zip(plain.named_parameters(), copied.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert all(p.grad is None for p in model.parameters())  # the original's layers did not run


@pytest.mark.parametrize("mode", MODES)
def test_under_the_importance_policy_a_stale_graph_replays_bitwise_as_without_checkpointing(mode):
    plain, checkpointed = pair(
        dropout=0.1, staleness=StalenessPolicy(max_gradient_staleness=1, stale_mode="importance")
    )
    ids, mask = batch(seed=1)
    held = {}
    for trainer in (plain, checkpointed):
        held[id(trainer)] = seeded_forward(trainer, ids, mask, mode)
        other_ids, other_mask = batch(seed=100)
        out = seeded_forward(trainer, other_ids, other_mask, "retain", seed=50)
        trainer.backward(sft_loss(out.logprobs, other_mask))
        assert trainer.step()["base"].stepped
        report = trainer.backward(sft_loss(held[id(trainer)].logprobs, mask))
        assert list(report.ages.values()) == [{"base": 1}]
    assert_bitwise(grads(plain), grads(checkpointed))


@pytest.mark.parametrize("mode", MODES)
def test_a_forward_that_raises_inside_a_checkpointed_layer_leaves_the_next_step_bitwise(mode):
    # A user's hook (or a bad batch) raising mid-forward must not leave a checkpointed layer holding the wrong
    # parameters or state: the next forward and backward are bitwise those of the plain trainer.
    plain, checkpointed = pair(dropout=0.1)
    ids, mask = batch()
    layer = decoder_layers(checkpointed.model)[1]
    before = {name: p.detach().clone() for name, p in checkpointed.model.named_parameters()}

    def boom(module, args, kwargs):
        raise RuntimeError("injected inside layer 1")

    handle = layer.register_forward_pre_hook(boom, with_kwargs=True)
    with pytest.raises(RuntimeError, match="injected inside layer 1"):
        seeded_forward(checkpointed, ids, mask, mode)
    handle.remove()
    for name, p in checkpointed.model.named_parameters():
        assert torch.equal(p, before[name]), name
    for trainer in (plain, checkpointed):
        out = seeded_forward(trainer, ids, mask, mode)
        trainer.backward(sft_loss(out.logprobs, mask))
    assert_bitwise(grads(plain), grads(checkpointed))
