"""Each step's logical ranks run on their own longest row, not the segment's (`trainer_core/data/trim.py`).

The slots a segment processes are checked against per-batch padding counted
here from the shard file; the step-0 loss and gradient norm against plain
float64 autograd on each row cut to its own length (no padding at all); a
packed run against the same run with the cut switched off, bit for bit.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import tiny_tree
from trainer_core.config import config_from_dict
from trainer_core.data.trim import trim_padding
from trainer_core.model import build_trainer
from trainer_core.run import steps as step_module
from trainer_core.run.plan import build_plan, read_plan, run_dir_for, write_plan
from trainer_core.run.records import SegmentResult
from trainer_core.run.segment_main import segment_result_path, train_segment
from trainer_core.run.state import state_dir_for

STEPS = 3


def _planned(tmp_path: Path, **data) -> Path:
    tree = tiny_tree(
        tmp_path,
        train={
            "steps": STEPS,
            "steps_per_segment": STEPS,
            "global_batch_size": 8,
            "logical_dp": 4,
            "nproc_per_node": 1,
            "grad_clip": 1.0,
        },
    )
    tree["data"].update(data)
    config = config_from_dict(tree, config_dir=tmp_path)
    plan, shards = build_plan(config)
    run_dir = run_dir_for(config, plan.run_id)
    write_plan(plan, shards, run_dir)
    return run_dir


def _shard(run_dir: Path) -> dict[str, torch.Tensor]:
    plan = read_plan(run_dir)
    return load_file(str(run_dir / plan.segments[0].shard_file))


def _copy_plan(run_dir: Path, target: Path) -> Path:
    target.mkdir(parents=True)
    shutil.copy(run_dir / "plan.json", target / "plan.json")
    shutil.copytree(run_dir / "plan", target / "plan")
    return target


def _trained(run_dir: Path) -> tuple[SegmentResult, bytes]:
    train_segment(run_dir, 0)
    weights = (state_dir_for(run_dir, 0) / "base" / "params.safetensors").read_bytes()
    return SegmentResult.read(segment_result_path(run_dir, 0)), weights


def test_rows_are_cut_to_their_longest_real_row_rounded_to_8_and_packed_rows_are_left_alone():
    mask = torch.zeros(2, 32, dtype=torch.bool)
    mask[0, :5], mask[1, :11] = True, True
    rows = {"input_ids": torch.arange(64).view(2, 32), "attention_mask": mask, "loss_mask": mask.clone()}
    cut = trim_padding(rows)
    assert {name: tuple(t.shape) for name, t in cut.items()} == {name: (2, 16) for name in rows}
    for name, tensor in rows.items():
        assert torch.equal(cut[name], tensor[:, :16])
        assert not tensor[:, 16:].any() or name == "input_ids"  # only padding went
    packed = {**rows, "position_ids": torch.zeros(2, 32, dtype=torch.int64)}
    assert all(trim_padding(packed)[name] is tensor for name, tensor in packed.items())
    full = {**rows, "attention_mask": torch.ones(2, 32, dtype=torch.bool)}
    assert all(trim_padding(full)[name] is tensor for name, tensor in full.items())


def _float64_step_zero(run_dir: Path, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    """The step-0 loss and gradient norm by plain float64 autograd, each row cut to its own length."""
    model = build_trainer(read_plan(run_dir).run_config()).model.double()
    model.zero_grad(set_to_none=True)
    num_loss_tokens = int(batch["loss_mask"][:, 1:].sum())
    total = torch.zeros((), dtype=torch.float64)
    for ids, real, targets in zip(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], strict=True):
        length = int(real.sum())
        logits = model(input_ids=ids[None, :length]).logits[0, :-1]
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, ids[1:length, None])[:, 0]
        loss = -(logprobs[targets[1:length]]).sum() / num_loss_tokens
        loss.backward()
        total = total + loss.detach()
    norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters() if p.grad is not None))
    return float(total), norm


def test_an_unpacked_segment_runs_on_per_batch_padding_with_the_losses_of_unpadded_rows(tmp_path):
    run_dir = _planned(tmp_path)
    shard = _shard(run_dir)
    num_steps, batch_size, planned_len = shard["input_ids"].shape
    # Per-batch padding, counted independently: every row of a step padded to that step's longest row.
    per_batch = sum(batch_size * int(shard["attention_mask"][s].sum(dim=1).max()) for s in range(num_steps))
    result, _ = _trained(run_dir)
    assert result.num_tokens == int(shard["attention_mask"].sum())
    assert result.num_token_slots <= 1.05 * per_batch, (result.num_token_slots, per_batch)
    assert result.num_token_slots < num_steps * batch_size * planned_len  # the segment-wide padding is gone

    loss, norm = _float64_step_zero(run_dir, {name: tensor[0] for name, tensor in shard.items()})
    assert result.losses[0] == pytest.approx(loss, rel=1e-5, abs=0)
    assert result.grad_norms[0] == pytest.approx(norm, rel=1e-4, abs=0)


def test_a_packed_segment_is_bitwise_the_run_without_the_cut(tmp_path, monkeypatch):
    run_dir = _planned(tmp_path, pack=True)
    shard = _shard(run_dir)
    result, weights = _trained(run_dir)
    assert result.num_token_slots == shard["input_ids"].numel()  # every planned slot: nothing cut
    monkeypatch.setattr(step_module, "trim_padding", dict)  # the loop as it was: rows as planned
    uncut, uncut_weights = _trained(_copy_plan(run_dir, tmp_path / "uncut"))
    assert result.losses == uncut.losses and result.grad_norms == uncut.grad_norms
    assert weights == uncut_weights
