"""The pipeline's segment runner at L = 4: bitwise the same at any W, and when W changes between segments.

SFT and RL, unpacked and packed, each planned once and trained in two
segments of two steps: at W = 1 (in this process), then with W changing
between the segments (2 → 4 or 4 → 2) through real torchrun launches of
`trainer_core.run.segment_main`. Per-step losses, the saved weights
and the AdamW state must be bitwise equal to the W = 1 run. The SFT case
decays its rate (cosine to a floor, after a warm-up): every step's rate, on
both sides of the boundary and after the resume at another W, is the one
transformers' scheduler gives that step. A packed SFT case and an RL case run
their logical ranks' two rows as micro-batches of one row (two forwards and
backwards each): bitwise W-independent too. The SFT case evaluates held-out
files after every step and the RL case a held-out fraction at each segment's
end: the eval losses are bitwise the W = 1 run's too.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from infra.launch.launcher import launch
from tests.conftest import EXAMPLES, tiny_tree
from tests.trainer.test_lr_schedule import transformers_rates
from trainer_core.config import config_from_dict
from trainer_core.run.plan import build_plan, read_plan, run_dir_for, write_plan
from trainer_core.run.records import SegmentResult
from trainer_core.run.segment_main import segment_result_path, train_segment
from trainer_core.run.state import state_dir_for

pytestmark = pytest.mark.distributed

RL = {
    "data": {"path": str(EXAMPLES / "tiny" / "rl.jsonl"), "kind": "rl", "max_seq_len": 160},
    "rl": {"sft_coef": 0.1, "initial_policy_version": 3, "max_data_staleness": 1},
}
COSINE = {"train": {"lr_schedule": "cosine", "warmup_steps": 1, "min_lr_ratio": 0.1, "eval_every": 1}}
HELD_OUT = {"eval_path": str(EXAMPLES / "tiny" / "eval.jsonl")}
CASES = {  # config sections, and the world sizes of the two segments
    "sft": ({**COSINE, "data": HELD_OUT}, (2, 4)),
    "sft_packed": ({"data": {"pack": True}, "train": {"micro_batch_size": 1}}, (4, 2)),
    "rl": ({**RL, "data": {**RL["data"], "eval_fraction": 0.1}, "train": {"micro_batch_size": 1}}, (4, 2)),
    "rl_packed": ({**RL, "data": {**RL["data"], "pack": True}}, (2, 4)),
}


def planned(tmp_path: Path, sections: dict) -> Path:
    tree = tiny_tree(
        tmp_path,
        train={
            "steps": 4,
            "steps_per_segment": 2,
            "global_batch_size": 8,
            "logical_dp": 4,
            "nproc_per_node": 1,
            "collective_timeout_s": 120,
        },
    )
    for section, values in sections.items():
        tree.setdefault(section, {}).update(values)
    config = config_from_dict(tree, config_dir=tmp_path)
    plan, shards = build_plan(config)
    run_dir = run_dir_for(config, plan.run_id)
    write_plan(plan, shards, run_dir)
    return run_dir


def launch_segment(run_dir: Path, segment: int, world_size: int) -> None:
    lines: list[str] = []
    result = launch(
        "trainer_core.run.segment_main",
        ["--run-dir", str(run_dir), "--segment", str(segment)],
        nproc_per_node=world_size,
        timeout_s=300,
        on_line=lines.append,
    )
    assert result.returncode == 0, "\n".join(lines[-40:])


def outcome(run_dir: Path) -> dict:
    """Losses of both segments, the final weights' bytes and the AdamW state."""
    final = state_dir_for(run_dir, 1) / "base"
    results = [SegmentResult.read(segment_result_path(run_dir, s)) for s in (0, 1)]
    return {
        "losses": [r.losses for r in results],
        "learning_rates": [rate for r in results for rate in r.learning_rates],
        "eval_losses": [(step, loss) for r in results for step, loss in zip(r.eval_steps, r.eval_losses)],
        "num_tokens": [r.num_tokens for r in results],
        "stale": [r.num_stale_trajectories for r in results],
        "weights": (final / "params.safetensors").read_bytes(),
        "optimizer": (final / "optimizer.safetensors").read_bytes(),
        "world_sizes": [r.world_size for r in results],
        "threads": {r.threads_per_process for r in results},
    }


def assert_same_run(actual: dict, expected: dict) -> None:
    for key in ("losses", "learning_rates", "eval_losses", "num_tokens", "stale", "weights", "optimizer", "threads"):
        assert actual[key] == expected[key], key


def copy_plan(run_dir: Path, target: Path) -> Path:
    target.mkdir(parents=True)
    shutil.copy(run_dir / "plan.json", target / "plan.json")
    shutil.copytree(run_dir / "plan", target / "plan")
    return target


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_run_resumed_at_another_world_size_is_bitwise_the_run_at_one_process(case, tmp_path):
    sections, world_sizes = CASES[case]
    run_dir = planned(tmp_path, sections)
    changing = copy_plan(run_dir, tmp_path / "changing")
    for segment in (0, 1):
        train_segment(run_dir, segment)  # W = 1, in this process (conftest restores its threads)
    reference = outcome(run_dir)
    assert reference["world_sizes"] == [1, 1] and reference["threads"] == {1}
    train = read_plan(run_dir).run_config().train
    expected = transformers_rates(train.lr_schedule, train.warmup_steps, train.steps, train.min_lr_ratio, train.steps)
    assert reference["learning_rates"] == pytest.approx([train.learning_rate * r for r in expected], rel=0, abs=1e-15)
    if case in ("sft", "rl"):  # held-out rows (files, or a fraction), evaluated at any W bitwise alike
        assert len(reference["eval_losses"]) == (4 if case == "sft" else 2)
    if case.startswith("rl"):
        assert sum(reference["stale"]) > 0  # the staleness bound dropped trajectories: that path is covered too
    for segment, world_size in enumerate(world_sizes):
        launch_segment(changing, segment, world_size)
    resumed = outcome(changing)
    assert resumed["world_sizes"] == list(world_sizes)
    assert_same_run(resumed, reference)
