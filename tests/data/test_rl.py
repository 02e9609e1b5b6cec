"""RL trajectories through the plan: advantages, behaviour logprobs and policy versions in the shard."""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest
import torch

from tests.conftest import EXAMPLES, tiny_tree
from trainer_core.config import config_from_dict
from trainer_core.data import DataError, parse_record, resolve_advantages
from trainer_core.run.plan import build_plan

RL_DATA = EXAMPLES / "tiny" / "rl.jsonl"


def rl_config(tmp_path, **train):
    return config_from_dict(
        tiny_tree(tmp_path, data={"path": str(RL_DATA), "max_seq_len": 160, "kind": "rl"}, train=train),
        config_dir=tmp_path,
    )


def expected_documents() -> dict[tuple[int, ...], list[tuple[np.ndarray, float, int]]]:
    """Oracle from the raw file: loss-token logprobs, group-relative advantage (mean/std), version — keyed by token ids."""
    records = [json.loads(line) for line in RL_DATA.read_text().splitlines()]
    by_group = defaultdict(list)
    for record in records:
        by_group[record["group_id"]].append(record["reward"])
    result = defaultdict(list)
    for record in records:
        rewards = np.asarray(by_group[record["group_id"]])
        advantage = (record["reward"] - rewards.mean()) / (rewards.std() + 1e-6)
        ids = [t for m in record["messages"] if m["role"] == "assistant" for t in m["token_ids"]]
        logprobs = np.asarray(
            [x for m in record["messages"] if m["role"] == "assistant" for x in m["logprobs"]], dtype=np.float32
        )
        result[tuple(ids)].append((logprobs, advantage, record["policy_version"]))
    return result


@pytest.mark.parametrize("pack", [False, True])
def test_example_trajectories_land_in_the_shard_aligned_to_their_tokens(tmp_path, pack):
    config = rl_config(tmp_path)
    config.data.max_seq_len, config.data.pack = 160, pack
    plan, shards = build_plan(config)
    assert plan.data_kind == "rl" and plan.num_flat_groups > 0
    oracle = expected_documents()
    checked = 0
    for tensors in shards.values():
        assert tensors["advantages"].dtype == torch.float32 and tensors["behaviour_logprobs"].dtype == torch.float32
        assert tensors["policy_version"].dtype == torch.int64
        assert tensors["advantages"].shape == tensors["input_ids"].shape == tensors["policy_version"].shape
        loss = tensors["loss_mask"]
        assert not tensors["advantages"][~loss].any() and not tensors["behaviour_logprobs"][~loss].any()
        assert (tensors["policy_version"][~tensors["attention_mask"]] == -1).all()
        documents = tensors["document_ids"] if pack else tensors["attention_mask"].to(torch.int32)
        for step, row in np.ndindex(*loss.shape[:2]):
            for document in range(1, int(documents[step, row].max()) + 1):
                where = documents[step, row] == document
                targets = where & loss[step, row]
                ids = tuple(tensors["input_ids"][step, row][targets].tolist())
                candidates = oracle[ids]
                logprobs = tensors["behaviour_logprobs"][step, row][targets].numpy()
                advantages = tensors["advantages"][step, row][targets].numpy()
                versions = set(tensors["policy_version"][step, row][where].tolist())
                assert any(
                    np.array_equal(lp, logprobs) and np.allclose(advantages, adv, atol=1e-6) and versions == {v}
                    for lp, adv, v in candidates
                ), f"step {step} row {row} document {document} matches no trajectory of the file"
                checked += 1
    assert checked >= 6 * 8


def test_given_advantages_are_used_as_they_are_and_per_turn_ones_per_turn():
    trajectory = parse_record(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a", "logprobs": [-0.5]},
                ],
                "advantage": 0.7,
                "reward": 5.0,
                "group_id": "g",
                "policy_version": 1,
            }
        ),
        "f:1",
    )
    per_turn = parse_record(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a", "logprobs": [-1.0], "advantage": 2.0},
                    {"role": "user", "content": "q2"},
                    {"role": "assistant", "content": "b", "logprobs": [-1.0], "reward": 1.0},
                ],
                "group_id": "g",
                "policy_version": 1,
            }
        ),
        "f:2",
    )
    other = parse_record(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "c", "logprobs": [-1.0]},
                ],
                "reward": 3.0,
                "group_id": "g",
                "policy_version": 1,
            }
        ),
        "f:3",
    )
    advantages, stats = resolve_advantages([trajectory, per_turn, other], ["f:1", "f:2", "f:3"])
    assert advantages[0].tolist() == [0.7, 0.7]
    # the group pools the rewards 1.0 (a turn) and 3.0 (a trajectory): normalised to -1 and +1
    np.testing.assert_allclose(advantages[1][[1, 3]], [2.0, -1.0], atol=1e-5)
    np.testing.assert_allclose(advantages[2], [1.0, 1.0], atol=1e-5)
    assert (stats.num_groups, stats.num_flat_groups) == (1, 0)
    mean_only, _ = resolve_advantages([per_turn, other], ["f:2", "f:3"], normalization="mean")
    np.testing.assert_allclose([mean_only[0][3], *mean_only[1]], [-1.0, 1.0, 1.0])


def test_rewards_on_both_levels_are_an_error():
    with pytest.raises(
        DataError, match=r"^f:9: field reward: give rewards/advantages either per trajectory or per assistant turn"
    ):
        parse_record(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": "q"},
                        {"role": "assistant", "content": "a", "logprobs": [-1.0], "reward": 1.0},
                    ],
                    "reward": 1.0,
                    "group_id": "g",
                    "policy_version": 0,
                }
            ),
            "f:9",
        )


def test_the_kind_of_data_must_match_data_kind(tmp_path):
    rl_as_sft = config_from_dict(
        tiny_tree(tmp_path, data={"path": str(RL_DATA), "max_seq_len": 160}), config_dir=tmp_path
    )
    with pytest.raises(DataError, match=r"rl\.jsonl: the records are RL trajectories .* but data\.kind='sft'"):
        build_plan(rl_as_sft)
    sft_as_rl = config_from_dict(tiny_tree(tmp_path, data={"kind": "rl"}), config_dir=tmp_path)
    with pytest.raises(DataError, match=r"sft\.jsonl: data\.kind='rl' but the records carry no reward or advantage"):
        build_plan(sft_as_rl)
