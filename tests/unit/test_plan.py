"""The plan: deterministic, digest-named, validated before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import EXAMPLES, tiny_tree
from trainer_core.config import config_from_dict
from trainer_core.data import streaming
from trainer_core.run.plan import build_plan, read_plan, run_dir_for, write_plan


def test_same_inputs_same_plan_and_digest(tiny_config):
    first, shards_a = build_plan(tiny_config)
    second, shards_b = build_plan(tiny_config)
    assert first.digest == second.digest and first.run_id == second.run_id
    for index in shards_a:
        for name in shards_a[index]:
            assert torch.equal(shards_a[index][name], shards_b[index][name])


def test_digest_changes_with_what_decides_the_result_only(tmp_path, tiny_config):
    base, _ = build_plan(tiny_config)
    reseeded, _ = build_plan(config_from_dict(tiny_tree(tmp_path, run={"seed": 8}), config_dir=tmp_path))
    elsewhere, _ = build_plan(
        config_from_dict(
            tiny_tree(tmp_path, storage={"url": "s3://bucket/prefix"}, run={"work_dir": str(tmp_path / "w2")}),
            config_dir=tmp_path,
        )
    )
    assert reseeded.digest != base.digest
    assert elsewhere.digest == base.digest


def test_segments_cover_every_step_with_global_batches(tiny_config):
    plan, shards = build_plan(tiny_config)
    assert [(s.start_step, s.end_step) for s in plan.segments] == [(0, 3), (3, 6)]
    for segment in plan.segments:
        tensors = shards[segment.index]
        assert tensors["input_ids"].shape[:2] == (3, 8)
        assert not tensors["loss_mask"][..., 0].any()  # position 0 has no predecessor
        assert int(tensors["loss_mask"].sum()) == segment.num_loss_tokens
        assert (tensors["loss_mask"] <= tensors["attention_mask"]).all()


def test_write_then_read_round_trips(tiny_config):
    plan, shards = build_plan(tiny_config)
    run_dir = run_dir_for(tiny_config, plan.run_id)
    write_plan(plan, shards, run_dir)
    assert read_plan(run_dir) == plan


def test_plan_records_one_digest_per_data_stage(tmp_path, tiny_config):
    plan, _ = build_plan(tiny_config)
    assert set(plan.stage_digests) == {"render", "tokenize", "mask", "align"} and plan.data_kind == "sft"
    data = tmp_path / "edited.jsonl"
    original = open(tiny_config.data.path, encoding="utf-8").read().splitlines()
    data.write_text("\n".join([original[0].replace("Tokyo", "Kyoto"), *original[1:]]) + "\n")
    edited, _ = build_plan(config_from_dict(tiny_tree(tmp_path, data={"path": str(data)}), config_dir=tmp_path))
    assert all(edited.stage_digests[s] != plan.stage_digests[s] for s in plan.stage_digests)
    assert edited.digest != plan.digest


def test_replanning_unchanged_inputs_reuses_the_stage_cache(tiny_config, monkeypatch):
    first, shards_first = build_plan(tiny_config)
    assert len(list((Path(tiny_config.run.work_dir) / "cache").glob("*.store"))) == 1
    monkeypatch.setattr(streaming, "tokenize", lambda *args, **kwargs: pytest.fail("tokenized again despite the cache"))
    second, shards_second = build_plan(tiny_config)
    assert (second.digest, second.stage_digests) == (first.digest, first.stage_digests)
    for index in shards_first:
        for name in shards_first[index]:
            assert torch.equal(shards_first[index][name], shards_second[index][name])
    # The length limit applies after the cached stages, so a new limit reuses them too.
    tiny_config.data.max_seq_len, tiny_config.data.overflow = 40, "drop"
    assert build_plan(tiny_config)[0].num_dropped > 0


def test_rl_trajectories_round_trip_through_the_stage_cache(tmp_path):
    tree = tiny_tree(tmp_path, data={"path": str(EXAMPLES / "tiny" / "rl.jsonl"), "kind": "rl"})
    config = config_from_dict(tree, config_dir=tmp_path)
    fresh, fresh_shards = build_plan(config)
    cached, cached_shards = build_plan(config)
    assert cached.num_flat_groups == fresh.num_flat_groups and cached.digest == fresh.digest
    assert set(cached_shards[0]) >= {"advantages", "behaviour_logprobs", "policy_version"}
    for name, tensor in fresh_shards[0].items():
        assert torch.equal(tensor, cached_shards[0][name]), name


def test_the_number_of_processes_enters_the_digest_only_when_it_can_change_the_result(tmp_path):
    def digest(**train):
        return build_plan(config_from_dict(tiny_tree(tmp_path, train=train), config_dir=tmp_path))[0].digest

    # Deterministic reduction: W changes only the speed, so a run resumed at another W keeps its id.
    assert digest(logical_dp=4, nproc_per_node=1) == digest(logical_dp=4, nproc_per_node=4)
    # A fast reduction's last bits depend on W; the reduction and the thread count decide results too.
    assert digest(logical_dp=4, nproc_per_node=1, reduction="fast") != digest(
        logical_dp=4, nproc_per_node=4, reduction="fast"
    )
    assert digest(logical_dp=4, reduction="fast") != digest(logical_dp=4)
    assert digest(logical_dp=4, threads_per_process=2) != digest(logical_dp=4)
