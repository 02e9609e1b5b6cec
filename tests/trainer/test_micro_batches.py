"""Micro-batches (`train.micro_batch_size`): a logical rank's rows in several forwards, its gradient their sum.

References: plain float64 autograd of the logical rank's whole batch in one forward (gradients and loss to 1e-12);
the trainer's own bytes for the memory effect. Bitwise W-independence at a micro-batch size is in
tests/ranks/test_segments_across_world_sizes.py (its packed SFT and RL cases run micro-batches of one row).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import tiny_tree
from trainer_core.config import ConfigError, config_from_dict
from trainer_core.model import build_trainer
from trainer_core.objectives import objective_for
from trainer_core.run.figures import FigureLayout
from trainer_core.run.plan import build_plan, digest_view, read_plan, run_dir_for, write_plan
from trainer_core.run.records import SegmentResult
from trainer_core.run.segment_main import segment_result_path, train_segment
from trainer_core.run.steps import logical_rank_work, micro_batches

ROWS = 8  # one logical rank's share of the step: global_batch_size 8, logical_dp 1


def _config(tmp_path: Path, **train):
    tree = tiny_tree(
        tmp_path,
        train={
            "steps": 1,
            "steps_per_segment": 1,
            "global_batch_size": ROWS,
            "logical_dp": 1,
            "nproc_per_node": 1,
            **train,
        },
    )
    return config_from_dict(tree, config_dir=tmp_path)


def _planned(tmp_path: Path, **train) -> Path:
    config = _config(tmp_path, **train)
    plan, shards = build_plan(config)
    run_dir = run_dir_for(config, plan.run_id)
    write_plan(plan, shards, run_dir)
    return run_dir


def _step_zero_rows(run_dir: Path) -> dict[str, torch.Tensor]:
    plan = read_plan(run_dir)
    return {name: tensor[0] for name, tensor in load_file(str(run_dir / plan.segments[0].shard_file)).items()}


def _float64_trainer(run_dir: Path):
    trainer = build_trainer(read_plan(run_dir).run_config())
    trainer.model.double()
    return trainer


def _whole_batch_float64(run_dir: Path, rows: dict[str, torch.Tensor], num_loss_tokens: int):
    """Plain autograd, float64, all rows in one padded forward: the loss and every parameter's gradient."""
    model = _float64_trainer(run_dir).model
    ids, mask, targets = rows["input_ids"], rows["attention_mask"], rows["loss_mask"][:, 1:]
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    logprobs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss_sum = -(logprobs * targets).sum()
    (loss_sum / num_loss_tokens).backward()
    return float(loss_sum), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("size", [1, 3, 8])
def test_micro_batched_float64_is_the_whole_batch_to_1e_12(tmp_path, size):
    run_dir = _planned(tmp_path)
    rows = _step_zero_rows(run_dir)
    num_loss_tokens = int(rows["loss_mask"][:, 1:].sum())
    expected_loss, expected_grads = _whole_batch_float64(run_dir, rows, num_loss_tokens)

    config = read_plan(run_dir).run_config()
    trainer = _float64_trainer(run_dir)
    objective = objective_for(config)
    layout = FigureLayout.for_objective(objective.figures)
    figures = layout.unpack(
        logical_rank_work(
            objective,
            layout,
            trainer,
            rows,
            step=0,
            rank=0,
            revision=0,
            num_loss_tokens=num_loss_tokens,
            mode=None,
            micro_batch_size=size,
        )
    )
    assert len(micro_batches(rows, size)) == -(-ROWS // size)
    assert figures["loss_sum"] == pytest.approx(expected_loss, abs=1e-12, rel=0)
    assert figures["input_tokens"] == int(rows["attention_mask"].sum())
    for name, param in trainer.model.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, expected_grads[name], rtol=0, atol=1e-12, msg=name)


def test_micro_batches_cut_the_rows_in_order_and_keep_every_one():
    rows = {"input_ids": torch.arange(14).view(7, 2), "loss_mask": torch.ones(7, 2, dtype=torch.bool)}
    pieces = micro_batches(rows, 3)
    assert [p["input_ids"].shape[0] for p in pieces] == [3, 3, 1]
    assert torch.equal(torch.cat([p["input_ids"] for p in pieces]), rows["input_ids"])
    assert (
        micro_batches(rows, None) == [rows] and micro_batches(rows, 7) == [rows] and micro_batches(rows, 99) == [rows]
    )


def test_peak_saved_bytes_fall_with_the_micro_batch(tmp_path):
    """The trainer's measured peak of saved activations: one row's forward at a time keeps far less than eight."""
    peaks = {}
    for size in (None, 1):
        run_dir = _planned(tmp_path / str(size), micro_batch_size=size)
        train_segment(run_dir, 0)
        peaks[size] = SegmentResult.read(segment_result_path(run_dir, 0)).peak_saved_bytes
    assert 0 < peaks[1] < peaks[None] / 3, peaks


def test_a_micro_batch_of_the_whole_share_is_the_run_without_one(tmp_path):
    """Same forwards, same bits, same run id; a smaller one is another run."""
    plain = digest_view(_config(tmp_path))
    assert digest_view(_config(tmp_path, micro_batch_size=ROWS)) == plain
    assert digest_view(_config(tmp_path, micro_batch_size=10 * ROWS)) == plain
    assert digest_view(_config(tmp_path, micro_batch_size=2)) != plain


@pytest.mark.parametrize("value", [0, -1, 1.5, "two"])
def test_a_bad_micro_batch_size_is_refused_naming_the_key(tmp_path, value):
    with pytest.raises(ConfigError, match="train.micro_batch_size"):
        _config(tmp_path, micro_batch_size=value)
