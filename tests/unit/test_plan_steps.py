"""build_plan's named steps: the segment bounds cut once, and the digest over config, inputs and shard bytes."""

from __future__ import annotations

import torch

from tests.conftest import tiny_tree
from trainer_core.config import config_from_dict
from trainer_core.run.plan import plan_digest, segment_bounds


def _config(tmp_path, **train):
    return config_from_dict(tiny_tree(tmp_path, train=train), config_dir=tmp_path)


def test_the_bounds_cut_the_steps_every_segment_and_end_at_the_last_step(tmp_path):
    assert segment_bounds(_config(tmp_path, steps=7, steps_per_segment=3)) == [(0, 3), (3, 6), (6, 7)]
    assert segment_bounds(_config(tmp_path, steps=4, steps_per_segment=4)) == [(0, 4)]
    assert segment_bounds(_config(tmp_path, steps=2, steps_per_segment=5)) == [(0, 2)]


def test_the_digest_names_config_inputs_and_every_shard_byte(tmp_path):
    config = _config(tmp_path, steps=4, steps_per_segment=2)
    shards = {0: {"input_ids": torch.tensor([[1, 2, 3]])}, 1: {"input_ids": torch.tensor([[4, 5, 6]])}}
    digest = plan_digest(config, {"data": "a"}, shards)
    assert plan_digest(config, {"data": "a"}, shards) == digest
    assert plan_digest(config, {"data": "b"}, shards) != digest
    flipped = {**shards, 1: {"input_ids": torch.tensor([[4, 5, 7]])}}
    assert plan_digest(config, {"data": "a"}, flipped) != digest
    assert (
        plan_digest(_config(tmp_path, steps=4, steps_per_segment=2, learning_rate=2e-4), {"data": "a"}, shards)
        != digest
    )
