"""The pipeline's non-finite policy, `train.nonfinite`: skip the update on every rank and count it, or fail.

A NaN is injected into one rank's loss at one step (`RANKFLOW_NONFINITE_LOSS=STEP:RANK`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import tiny_tree
from tests.plan_helpers import planned_run_dir
from tests.trainer.ranks import launch_two_ranks
from trainer_core.config import ConfigError, config_from_dict
from trainer_core.run.faults import NONFINITE_LOSS_ENV
from trainer_core.run.records import SegmentResult
from trainer_core.run.segment_main import segment_result_path, train_segment
from trainer_core.run.state import state_dir_for


def planned_run(tmp_path: Path, nproc_per_node: int = 1, **train) -> Path:
    tree = tiny_tree(tmp_path, train={"steps": 3, "steps_per_segment": 3, "nproc_per_node": nproc_per_node, **train})
    return planned_run_dir(config_from_dict(tree, config_dir=tmp_path))


def saved_revision(run_dir: Path) -> int:
    return json.loads((state_dir_for(run_dir, 0) / "base" / "version.json").read_text())["revision"]


def test_the_default_skips_a_non_finite_step_and_counts_it(tmp_path, monkeypatch):
    run_dir = planned_run(tmp_path)
    monkeypatch.setenv(NONFINITE_LOSS_ENV, "1:0")
    train_segment(run_dir, 0)
    result = SegmentResult.read(segment_result_path(run_dir, 0))
    assert result.skipped_steps == [1] and result.num_skipped_steps == 1
    assert math.isnan(result.losses[1])  # a NaN loss is a legal figure: written as NaN, read back as one
    assert saved_revision(run_dir) == 2  # three steps, one skipped


def test_error_fails_the_segment_naming_the_step_and_the_key(tmp_path, monkeypatch):
    run_dir = planned_run(tmp_path, nonfinite="error")
    monkeypatch.setenv(NONFINITE_LOSS_ENV, "1:0")
    with pytest.raises(RuntimeError, match=r"step 1: non-finite .*train\.nonfinite"):
        train_segment(run_dir, 0)
    assert not segment_result_path(run_dir, 0).exists()


def test_an_unknown_policy_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="train.nonfinite"):
        config_from_dict(tiny_tree(tmp_path, train={"nonfinite": "ignore"}), config_dir=tmp_path)


@pytest.mark.distributed
def test_a_nan_on_one_rank_skips_the_update_on_every_rank(tmp_path):
    run_dir = planned_run(tmp_path, nproc_per_node=2)
    lines = launch_two_ranks(
        "trainer_core.run.segment_main", ["--run-dir", str(run_dir), "--segment", "0"], env={NONFINITE_LOSS_ENV: "2:1"}
    )
    outcome = SegmentResult.read(segment_result_path(run_dir, 0))
    assert outcome.skipped_steps == [2] and outcome.num_skipped_steps == 1
    assert sum("step 2: non-finite gradient norm" in line and "skipped on every rank" in line for line in lines) == 2
    assert saved_revision(run_dir) == 2
