"""Bounded staleness: stale graphs differentiate at the weights they ran at, or error past the bound."""

from __future__ import annotations

import copy
import gc
import tempfile

import pytest
import torch

from tests.trainer.models import batch, tiny_qwen3
from tests.trainer.test_backward_state import reference_logprobs, sft_loss
from trainer_core.training import OptimizerConfig, StaleGraphError, StalenessPolicy, Trainer, importance_weights

OPTIMIZER = OptimizerConfig(learning_rate=1e-2, grad_clip=0.0)


def make_trainer(max_staleness: int = 2, stale_mode: str = "snapshot", dtype=torch.float32) -> Trainer:
    trainer = Trainer(
        tiny_qwen3(dtype=dtype).train(),
        staleness=StalenessPolicy(max_gradient_staleness=max_staleness, stale_mode=stale_mode),
    )
    trainer.add_base_checkpoint(optimizer=OPTIMIZER)
    return trainer


def take_steps(trainer: Trainer, count: int) -> None:
    for seed in range(count):
        ids, mask = batch(seed=100 + seed)
        out = trainer.forward(ids, mask, mode="retain")
        trainer.backward(sft_loss(out.logprobs, mask))
        assert trainer.step()["base"].stepped


def float64_grads(model, input_ids, attention_mask) -> list[torch.Tensor]:
    oracle = copy.deepcopy(model).double()
    sft_loss(reference_logprobs(oracle, input_ids, attention_mask), attention_mask).backward()
    return [p.grad for p in oracle.parameters()]


# A float64 trainer is held to float64 precision; a float32 one to float32's.
TOLERANCES = {torch.float64: {"rtol": 1e-10, "atol": 1e-13}, torch.float32: {"rtol": 1e-4, "atol": 1e-6}}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("mode", ["retain", "offload", "replay"])
def test_a_graph_two_steps_old_gets_the_gradient_at_its_version(mode, dtype):
    trainer = make_trainer(dtype=dtype)
    ids, mask = batch(seed=1)
    at_version = copy.deepcopy(trainer.model)
    out = trainer.forward(ids, mask, mode=mode)
    take_steps(trainer, 2)
    report = trainer.backward(sft_loss(out.logprobs, mask))
    assert list(report.ages.values()) == [{"base": 2}]
    for live, oracle in zip(trainer.model.parameters(), float64_grads(at_version, ids, mask)):
        assert live.grad.dtype == dtype
        torch.testing.assert_close(live.grad.double(), oracle, **TOLERANCES[dtype])


def test_a_third_step_makes_it_an_error_naming_checkpoint_age_and_bound():
    trainer = make_trainer()
    ids, mask = batch(seed=1)
    out = trainer.forward(ids, mask, mode="retain")
    take_steps(trainer, 3)
    with pytest.raises(
        StaleGraphError, match=r"checkpoint 'base': graph is 3 optimizer step\(s\) old, over max_gradient_staleness=2"
    ):
        trainer.backward(sft_loss(out.logprobs, mask))
    assert all(p.grad is None for p in trainer.model.parameters())


def test_strict_bound_refuses_any_step_in_between_and_keeps_no_snapshot():
    trainer = make_trainer(max_staleness=0)
    ids, mask = batch(seed=1)
    out = trainer.forward(ids, mask, mode="retain")
    params_before = [id(p) for p in trainer.model.parameters()]
    take_steps(trainer, 1)
    assert [id(p) for p in trainer.model.parameters()] == params_before  # stepped in place, no copy
    with pytest.raises(StaleGraphError, match="1 optimizer step\\(s\\) old, over max_gradient_staleness=0"):
        trainer.backward(sft_loss(out.logprobs, mask))


def test_a_replaced_checkpoint_is_always_an_error():
    trainer = make_trainer(max_staleness=5)
    ids, mask = batch(seed=1)
    out = trainer.forward(ids, mask, mode="retain")
    checkpoint = trainer.checkpoints["base"]
    checkpoint.replace({n: p.detach().clone() for n, p in checkpoint.parameters().items()})
    with pytest.raises(StaleGraphError, match="checkpoint 'base' was replaced"):
        trainer.backward(sft_loss(out.logprobs, mask))


def test_importance_weight_formula_and_clamps_exactly():
    current = torch.tensor([0.0, -1.0, -3.0, -0.5], dtype=torch.float64)
    recorded = torch.tensor([0.0, -2.0, -1.0, -0.5 - 1e-3], dtype=torch.float64)
    weights = importance_weights(current, recorded, 0.2, 2.0)
    expected = torch.tensor(
        [1.0, 2.0, 0.2, float(torch.exp(torch.tensor(1e-3, dtype=torch.float64)))], dtype=torch.float64
    )
    assert torch.equal(weights, expected)  # e^1 clamps to 2.0, e^-2 to 0.2
    assert not weights.requires_grad


@pytest.mark.parametrize("mode", ["retain", "offload", "replay", None])
def test_importance_replay_uses_current_weights_with_weighted_logprob_cotangents(mode, tmp_path, monkeypatch):
    """Every backward mode (None: the planner's choice) gives the importance gradient for a stale graph."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    trainer = make_trainer(stale_mode="importance")
    low, high = trainer.staleness.importance_low, trainer.staleness.importance_high
    ids, mask = batch(seed=1)
    out = trainer.forward(ids, mask, mode=mode)
    recorded = out.logprobs.detach().clone()
    params_before = [id(p) for p in trainer.model.parameters()]
    take_steps(trainer, 1)
    assert [id(p) for p in trainer.model.parameters()] == params_before  # importance keeps no snapshot
    # A stale graph keeps what a replay needs, no saved tensors: at most the copies of its inputs.
    assert trainer.resident_bytes() <= ids.nbytes + mask.nbytes
    current = copy.deepcopy(trainer.model)
    trainer.backward(sft_loss(out.logprobs, mask))
    logprobs_now = reference_logprobs(current, ids, mask)
    weights = torch.exp(logprobs_now.detach() - recorded).clamp(low, high)
    sft_loss(weights * logprobs_now, mask).backward()
    for live, reference in zip(trainer.model.parameters(), current.parameters()):
        torch.testing.assert_close(live.grad, reference.grad, rtol=1e-5, atol=1e-7)
    del out
    gc.collect()
    assert trainer.resident_bytes() == 0 and list(tmp_path.iterdir()) == []  # disk offload's files went too


def test_bad_policy_is_rejected():
    with pytest.raises(ValueError, match="max_gradient_staleness=-1"):
        StalenessPolicy(max_gradient_staleness=-1)


@pytest.mark.parametrize("mode", ["retain", "offload", "replay"])
def test_importance_policy_leaves_a_fresh_graph_exact(mode):
    trainer = make_trainer(stale_mode="importance")
    reference = copy.deepcopy(trainer.model)
    ids, mask = batch(seed=1)
    torch.manual_seed(0)
    out = trainer.forward(ids, mask, mode=mode)
    trainer.backward(sft_loss(out.logprobs, mask))
    torch.manual_seed(0)
    sft_loss(reference_logprobs(reference, ids, mask), mask).backward()
    for live, expected in zip(trainer.model.parameters(), reference.parameters()):
        torch.testing.assert_close(live.grad, expected.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["retain", "offload", "replay"])
def test_a_stale_graph_through_a_value_head_gets_both_checkpoints_gradients_at_its_version(mode):
    trainer = make_trainer()
    torch.manual_seed(3)
    head = torch.nn.Linear(32, 1)
    trainer.add_module_checkpoint("value", head, optimizer=OPTIMIZER)
    ids, mask = batch(seed=1)
    model_then, head_then = copy.deepcopy(trainer.model), copy.deepcopy(head)
    out = trainer.forward(ids, mask, outputs=("logprobs", "heads"), mode=mode)
    for seed in range(2):  # both checkpoints step twice while `out` waits
        other_ids, other_mask = batch(seed=100 + seed)
        other = trainer.forward(other_ids, other_mask, outputs=("logprobs", "heads"))
        trainer.backward(sft_loss(other.logprobs, other_mask) + other.heads["value"].pow(2).mean())
        assert all(report.stepped for report in trainer.step().values())
    report = trainer.backward(sft_loss(out.logprobs, mask) + out.heads["value"].pow(2).mean())
    assert list(report.ages.values()) == [{"base": 2, "value": 2}]
    result = model_then(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    logprobs = torch.log_softmax(result.logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (sft_loss(logprobs, mask) + head_then(result.hidden_states[-1]).pow(2).mean()).backward()
    for live, expected in [(trainer.model, model_then), (head, head_then)]:
        for p, q in zip(live.parameters(), expected.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
