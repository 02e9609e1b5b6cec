"""The streamed plan is today's plan: same run id, same digests, bitwise the same shard files.

The reference is the plan as it was before it streamed (bench/_plan_in_memory.py:
every record in memory, the stages over the whole file in one batch, every shard
in one dict, written with `save_file`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from bench._plan_in_memory import plan_in_memory, write_in_memory
from tests.conftest import EXAMPLES, tiny_tree
from trainer_core.config import config_from_dict, load_config
from trainer_core.data import DataError, streaming
from trainer_core.run.plan import build_plan, run_dir_for, write_plan
from trainer_core.run.validate import validate_inputs

RL = {"path": str(EXAMPLES / "tiny" / "rl.jsonl"), "kind": "rl", "max_seq_len": 160}


def _assert_same_plan(config, tmp_path: Path) -> None:
    plan, shards = build_plan(config)
    run_dir = run_dir_for(config, plan.run_id)
    write_plan(plan, shards, run_dir)
    reference = plan_in_memory(config)
    assert (plan.run_id, plan.digest, plan.stage_digests) == (
        reference.run_id,
        reference.digest,
        reference.stage_digests,
    )
    expected = write_in_memory(reference, tmp_path / "reference")
    written = [run_dir / s.shard_file for s in plan.segments]
    assert len(written) == len(expected)
    for mine, theirs in zip(written, expected):
        assert mine.read_bytes() == theirs.read_bytes(), mine.name


@pytest.mark.parametrize("example", ["tiny_sft", "tiny_rl"])
def test_the_example_plans_are_the_plans_of_before(example, tmp_path):
    config = load_config(
        EXAMPLES / f"{example}.toml", [f"run.work_dir={tmp_path / 'work'}", f"storage.url={tmp_path / 'store'}"]
    )
    # The in-memory plan predates held-out data (tiny_sft evaluates tiny/eval.jsonl): compared without it.
    config.data.eval_path, config.train.eval_every = None, 0
    _assert_same_plan(config, tmp_path)


@pytest.mark.parametrize(
    "data",
    [
        {"pack": True},
        {"max_seq_len": 40, "overflow": "truncate"},
        {**RL, "max_seq_len": 64, "overflow": "drop", "pack": True},
    ],
    ids=["packed", "truncated", "rl-dropped-packed"],
)
def test_small_chunks_and_length_limits_give_the_plans_of_before(data, tmp_path, monkeypatch):
    # Chunks of 7 records: many chunk boundaries, each stage digest fed across all of them.
    monkeypatch.setattr(streaming, "CHUNK_RECORDS", 7)
    config = config_from_dict(tiny_tree(tmp_path, data=data), config_dir=tmp_path)
    _assert_same_plan(config, tmp_path)


def test_a_bad_record_leaves_no_scratch_and_no_work_dir(tmp_path, monkeypatch):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setattr(streaming, "CHUNK_RECORDS", 16)
    lines = (EXAMPLES / "tiny" / "sft.jsonl").read_text().splitlines()
    lines[100] = lines[100].replace('"assistant"', '"asistant"', 1)  # a bad role, several chunks in
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(lines) + "\n")
    config = config_from_dict(tiny_tree(tmp_path, data={"path": str(data)}), config_dir=tmp_path)
    with pytest.raises(DataError, match=rf"^{data}:101: field messages\.\d+\.role"):
        validate_inputs(config)
    # (torch may keep its own cache there: only the plan's scratch stores are looked for)
    assert not [n for n in os.listdir(scratch) if n.startswith("rankflow-stages-")]
    assert not (tmp_path / "work").exists()
