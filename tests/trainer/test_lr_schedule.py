"""Learning-rate schedules against transformers' schedulers, stepped on a real optimizer as the HF Trainer does.

The reference of step s is the rate `LambdaLR` leaves in the optimizer after s calls of `scheduler.step()`: the
rate the HF Trainer's optimizer step s runs at. Every form is held to it to 1e-12, and a trainer step with a
scheduled checkpoint to `torch.optim.AdamW` driven by that scheduler.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

from tests.trainer.models import batch, tiny_qwen3
from tests.trainer.test_backward_state import sft_loss
from trainer_core.lr_schedule import LRSchedule
from trainer_core.training import OptimizerConfig, Trainer

SHAPES = [(0, 10), (3, 10), (10, 10), (1, 1), (4, 37), (12, 7)]  # (warmup, total): none, some, all, past the end


def transformers_rates(kind: str, warmup: int, total: int, ratio: float, steps: int) -> list[float]:
    """transformers' rate at steps 0..steps-1 for base rate 1."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    if kind == "constant":
        scheduler = transformers.get_constant_schedule_with_warmup(optimizer, warmup)
    elif kind == "linear" and ratio == 0:
        scheduler = transformers.get_linear_schedule_with_warmup(optimizer, warmup, total)
    elif kind == "linear":
        scheduler = transformers.get_polynomial_decay_schedule_with_warmup(
            optimizer, warmup, total, lr_end=ratio, power=1.0
        )
    elif ratio == 0:
        scheduler = transformers.get_cosine_schedule_with_warmup(optimizer, warmup, total)
    else:
        scheduler = transformers.get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, warmup, total, min_lr_rate=ratio
        )
    rates = [optimizer.param_groups[0]["lr"]]
    for _ in range(steps - 1):
        optimizer.step()
        scheduler.step()
        rates.append(optimizer.param_groups[0]["lr"])
    return rates


@pytest.mark.parametrize(("warmup", "total"), SHAPES)
@pytest.mark.parametrize(
    ("kind", "ratio"), [("constant", 0.0), ("linear", 0.0), ("linear", 0.1), ("cosine", 0.0), ("cosine", 0.1)]
)
def test_every_step_is_transformers_rate(kind, ratio, warmup, total):
    schedule = LRSchedule(kind, warmup, total, ratio)
    expected = transformers_rates(kind, warmup, total, ratio, total)
    actual = [schedule.multiplier(step) for step in range(total)]
    assert actual == pytest.approx(expected, abs=1e-12, rel=0)


def test_the_rate_holds_at_its_floor_past_the_last_step():
    """transformers' cosine climbs back past num_training_steps; a run that outlives its schedule stays at the floor."""
    schedule = LRSchedule("cosine", 2, 10, 0.1)
    assert [schedule.multiplier(s) for s in (10, 11, 1000)] == [pytest.approx(0.1, abs=1e-15)] * 3


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (("step", 0, 1, 0.0), "kind"),
        (("linear", -1, 1, 0.0), "warmup_steps"),
        (("linear", 0, 0, 0.0), "total_steps"),
        (("cosine", 0, 5, 1.5), "min_lr_ratio"),
        (("constant", 0, 5, 0.1), "decay"),
    ],
)
def test_a_bad_schedule_is_refused_naming_the_field(fields, words):
    with pytest.raises(ValueError, match=words):
        LRSchedule(*fields)


def test_a_scheduled_checkpoint_trains_as_adamw_under_transformers_scheduler():
    """Five steps of the trainer (its schedule at its revision) and of torch's AdamW stepped by transformers'
    cosine-with-floor scheduler, on copies of one model and the same batches: the reports' rates are the
    scheduler's to 1e-12 and the weights agree to float32 rounding."""
    base_rate, steps = 1e-2, 5
    model = tiny_qwen3().train()
    reference = copy.deepcopy(model)
    schedule = LRSchedule("cosine", 2, steps, 0.1)
    trainer = Trainer(model)
    trainer.add_base_checkpoint(optimizer=OptimizerConfig(learning_rate=base_rate, grad_clip=0.0, schedule=schedule))
    optimizer = torch.optim.AdamW(reference.parameters(), lr=base_rate, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    scheduler = transformers.get_cosine_with_min_lr_schedule_with_warmup(optimizer, 2, steps, min_lr_rate=0.1)
    for step in range(steps):
        ids, mask = batch(seed=step)
        out = trainer.forward(ids, mask)
        trainer.backward(sft_loss(out.logprobs, mask))
        report = trainer.step()["base"]
        logits = reference(input_ids=ids, attention_mask=mask).logits
        logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        expected_rate = optimizer.param_groups[0]["lr"]
        sft_loss(logprobs, mask).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        assert report.stepped and report.learning_rate == pytest.approx(expected_rate, abs=1e-12 * base_rate, rel=0)
    assert report.learning_rate < base_rate  # the decay was reached: not a constant rate passing by luck
    for (name, actual), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=name)


def test_a_checkpoints_own_schedule_wins_over_the_rate_the_step_gives():
    """`step(learning_rate=...)` is the rate of checkpoints without a schedule; one with its own follows it at
    `schedule_step`."""
    model = tiny_qwen3()
    trainer = Trainer(model)
    trainer.add_base_checkpoint(optimizer=OptimizerConfig(learning_rate=1e-3))
    head = nn.Linear(32, 1)
    own = LRSchedule("linear", 0, 4, 0.0)
    trainer.add_module_checkpoint("value", head, optimizer=OptimizerConfig(learning_rate=2e-3, schedule=own))
    ids, mask = batch()
    out = trainer.forward(ids, mask, outputs=("logprobs", "heads"))
    trainer.backward(sft_loss(out.logprobs, mask) + out.heads["value"].sum())
    reports = trainer.step(learning_rate=5e-4, schedule_step=3)
    assert reports["base"].learning_rate == 5e-4
    assert reports["value"].learning_rate == pytest.approx(2e-3 * 0.25, rel=1e-15)
    assert trainer.checkpoints["value"].optimizer.param_groups[0]["lr"] == reports["value"].learning_rate
