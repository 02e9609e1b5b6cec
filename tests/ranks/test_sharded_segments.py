"""The pipeline's segment runner with `train.sharding = "fsdp"` and the deterministic reduction: W-independent.

One plan (L = 4, three segments of two steps, grad_clip = 0.05 so that every
step clips) trained through
real torchrun launches of `trainer_core.run.segment_main`: at W = 2 for every
segment, and with W changing 2 → 1 → 2 (segment 1 resumes at W = 1 from the
DCP state saved at W = 2, segment 2 at W = 2 from the one saved at W = 1).
The reference is the unsharded deterministic run of the same data and config
(`sharding = "none"`, W = 1, in this process). Losses, the final weights and
the AdamW moments must be bitwise equal in all three (and the held-out loss
after every step), and the checkpoint
exported from the W = 2 shards must be bitwise the unsharded run's export.
Clipped: both deterministic reductions take the step's norm from
`ranks.canonical_norm`, so the clipped update is bitwise the same too.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from infra.launch.failures import FailureClass, diagnose_launch
from infra.launch.launcher import launch
from tests.ranks.test_segments_across_world_sizes import copy_plan, launch_segment, planned
from tests.trainer.models import tiny_qwen3
from trainer_core.model import build_trainer
from trainer_core.parallel.fsdp.checkpoint_io import restore_sharded_checkpoint
from trainer_core.ranks import LogicalDataParallel, Topology
from trainer_core.run.export_main import export_segment
from trainer_core.run.plan import read_plan
from trainer_core.run.records import SegmentResult
from trainer_core.run.segment_main import segment_result_path, train_segment
from trainer_core.run.sharded_facade import ShardedLogicalDataParallel, assignment_for, segment_facade
from trainer_core.run.state import load_training_state, state_dir_for
from trainer_core.training import Trainer

CLIP = 0.05
# 9 held-out rows over L = 4 logical ranks of 2 rows per forward: 2, 1, 1, 1 forwards, so on 2 processes one logical
# rank runs a throwaway forward to keep FSDP's all-gathers in step.
HELD_OUT = {"eval_fraction": 0.0075}
CLIPPED = {"train": {"grad_clip": CLIP, "steps": 6, "eval_every": 1}, "data": HELD_OUT}
SHARDINGS = ["fsdp", "hsdp"]  # HSDP at 1 node x W processes: its 2-D mesh is (1, W), resumed at (1, 1)


def sharded(sharding: str) -> dict:
    return {"train": {**CLIPPED["train"], "sharding": sharding}, "data": HELD_OUT}


SEGMENTS = range(3)
LAST = SEGMENTS[-1]


def results(run_dir: Path) -> list[SegmentResult]:
    return [SegmentResult.read(segment_result_path(run_dir, s)) for s in SEGMENTS]


def sharded_state(run_dir: Path, reference_dir: Path) -> dict[str, torch.Tensor]:
    """The final DCP state (weights and AdamW moments), read into the unsharded reference's model in this process."""
    trainer = build_trainer(read_plan(reference_dir).run_config())
    (checkpoint,) = trainer.checkpoints.values()
    restore_sharded_checkpoint(checkpoint, state_dir_for(run_dir, LAST) / checkpoint.name)
    return _state(checkpoint)


def unsharded_state(run_dir: Path) -> dict[str, torch.Tensor]:
    trainer = build_trainer(read_plan(run_dir).run_config())
    (checkpoint,) = trainer.checkpoints.values()
    load_training_state(state_dir_for(run_dir, LAST), trainer.checkpoints)
    return _state(checkpoint)


def _state(checkpoint) -> dict[str, torch.Tensor]:
    state = {f"param/{name}": p.detach().clone() for name, p in checkpoint.parameters().items()}
    for name, p in checkpoint.optimized_parameters().items():
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"{key}/{name}"] = checkpoint.optimizer.state[p][key].clone()
    return state


def assert_bitwise(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    unequal = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert not unequal, f"{len(unequal)} of {len(expected)} tensors differ, e.g. {unequal[:3]}"


def exported(run_dir: Path, out: Path, world_size: int) -> dict[str, torch.Tensor]:
    if world_size == 1:
        export_segment(run_dir, LAST, out)
    else:
        lines: list[str] = []
        result = launch(
            "trainer_core.run.export_main",
            ["--run-dir", str(run_dir), "--segment", str(LAST), "--out", str(out)],
            nproc_per_node=world_size,
            timeout_s=300,
            on_line=lines.append,
        )
        assert result.returncode == 0, "\n".join(lines[-40:])
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(out.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    return weights


def test_only_deterministic_logical_ranks_on_shards_run_round_robin():
    assert assignment_for("fsdp", "deterministic") == assignment_for("hsdp", "deterministic") == "round_robin"
    fast_or_replicated = [("fsdp", "fast"), ("hsdp", "fast"), ("none", "deterministic"), ("none", "fast")]
    assert {assignment_for(s, r) for s, r in fast_or_replicated} == {"contiguous"}


def test_the_facade_refuses_a_contiguous_topology_for_deterministic_logical_ranks_on_shards():
    class Sharded:  # what segment_facade looks at first: a trainer whose parallelism reduces in backward
        class parallelism:  # noqa: N801 - stands in for the trainer's attribute
            reduces_in_backward = True

    with pytest.raises(ValueError, match="run round-robin"):
        segment_facade(Sharded(), Topology(0, 1, 4), reduction="deterministic", seed=0, mode="retain")  # type: ignore[arg-type]


def test_an_unsharded_trainer_keeps_the_facade_of_its_reduction():
    for reduction in ("deterministic", "fast"):
        ldp = segment_facade(Trainer(tiny_qwen3()), Topology(0, 1, 4), reduction=reduction, seed=3, mode=None)
        assert type(ldp) is LogicalDataParallel and not isinstance(ldp, ShardedLogicalDataParallel)
        assert ldp.gradients.mode == reduction and ldp.topology.assignment == "contiguous"


@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP read in this process, on purpose
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_a_sharded_deterministic_run_is_bitwise_the_unsharded_one_at_any_w_and_resumed_at_another_w(tmp_path, sharding):
    reference_dir = planned(tmp_path / "none", CLIPPED)
    for segment in SEGMENTS:
        train_segment(reference_dir, segment)  # W = 1, unsharded, in this process
    reference = results(reference_dir)
    assert all(norm > 2 * CLIP for r in reference for norm in r.grad_norms)  # every step clips
    assert read_plan(reference_dir).num_eval_conversations == 9 and all(len(r.eval_losses) == 2 for r in reference)

    steady = planned(tmp_path / sharding, sharded(sharding))
    changing = copy_plan(steady, tmp_path / "changing")
    assert read_plan(steady).run_id != read_plan(reference_dir).run_id  # sharding is in the digest
    launch_segment(steady, 0, 2)
    # Segment 0's W = 2 state and result, then segment 1 at W = 1: the state reshards on load.
    shutil.copytree(state_dir_for(steady, 0), state_dir_for(changing, 0))
    segment_result_path(changing, 0).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(segment_result_path(steady, 0), segment_result_path(changing, 0))
    for segment in SEGMENTS[1:]:
        launch_segment(steady, segment, 2)
    launch_segment(changing, 1, 1)
    launch_segment(changing, 2, 2)  # and back: the W = 1 state resharded over 2 processes

    for run in (steady, changing):
        found = results(run)
        assert [r.losses for r in found] == [r.losses for r in reference], run.name
        assert [r.num_tokens for r in found] == [r.num_tokens for r in reference]
        assert [r.grad_norms for r in found] == [r.grad_norms for r in reference], run.name
        assert [r.eval_losses for r in found] == [r.eval_losses for r in reference], run.name
    assert [r.world_size for r in results(steady)] == [2, 2, 2]
    assert [r.world_size for r in results(changing)] == [2, 1, 2]
    expected = unsharded_state(reference_dir)
    assert_bitwise(sharded_state(steady, reference_dir), expected)
    assert_bitwise(sharded_state(changing, reference_dir), expected)

    assert_bitwise(
        exported(steady, tmp_path / f"export-{sharding}", 2), exported(reference_dir, tmp_path / "export-none", 1)
    )


@pytest.mark.distributed
@pytest.mark.parametrize("reduction", ["deterministic", "fast"])
def test_a_code_error_on_one_rank_of_a_sharded_step_is_diagnosed_as_its_own_not_retried(tmp_path, reduction):
    """Its peers are inside FSDP's collectives: a status exchange there would be matched against an all-gather
    (gloo aborts the process, no rank says why, and the launch reads as a dead rank a retry could help). The failing
    rank leaves with its error instead, and the launch names it from its record."""
    run_dir = planned(tmp_path / "run", {"train": {"sharding": "fsdp", "reduction": reduction}})
    env = {"RANKFLOW_FAULT_ONCE": f"1:1:{tmp_path / 'marker'}", "RANKFLOW_FAULT_KIND": "code"}
    result = launch(
        "trainer_core.run.segment_main",
        ["--run-dir", str(run_dir), "--segment", "0"],
        nproc_per_node=2,
        timeout_s=300,
        on_line=lambda _: None,
        env={**os.environ, **env},
    )
    failure = diagnose_launch(result, "segment")
    assert failure.cause is FailureClass.CODE_ERROR and not failure.retriable, failure.headline()
    assert failure.rank == 1 and "TypeError: injected fault at step 1 on rank 1" in failure.detail, failure.headline()


@pytest.mark.distributed
def test_hsdp_with_the_fast_reduction_trains_as_the_unsharded_run_within_rounding(tmp_path):
    """`reduction = "fast"`: the engine's own reduce-scatter inside backward (`ShardedSum`), not the ordered fold;
    the sums associate by W, so the run matches the unsharded one to float32 rounding, not to the bit."""
    reference_dir = planned(tmp_path / "none", CLIPPED)
    train_segment(reference_dir, 0)  # W = 1, unsharded, in this process
    fast = {"train": {**CLIPPED["train"], "sharding": "hsdp", "reduction": "fast"}, "data": HELD_OUT}
    run_dir = planned(tmp_path / "hsdp-fast", fast)
    launch_segment(run_dir, 0, 2)
    expected, got = (SegmentResult.read(segment_result_path(d, 0)) for d in (reference_dir, run_dir))
    assert got.losses == pytest.approx(expected.losses, rel=1e-4) and got.losses[0] == expected.losses[0]
    assert got.grad_norms == pytest.approx(expected.grad_norms, rel=1e-3)
    assert got.eval_losses == pytest.approx(expected.eval_losses, rel=1e-4)
    # Not the ordered fold: its sums associate differently from the unsharded run's, in the last bits.
    assert (got.losses, got.grad_norms) != (expected.losses, expected.grad_norms)
