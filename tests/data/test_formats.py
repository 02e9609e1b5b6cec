"""Every format and file type gives today's plan: the same conversations, the same shards, bit for bit.

The reference is the plan of the shipped JSONL files in the messages format
(examples/tiny/sft.jsonl, rl.jsonl), read by today's line reader. The
candidates hold the same records written another way by the libraries that
define those files (pyarrow's Parquet and Arrow IPC writers, `datasets`'
`save_to_disk`), converted to ShareGPT or prompt/completion by this test's
own mapping, or split over several files named by a list or a glob. Their
plans must have the reference's stage digests and bitwise its shard tensors
(tokens, masks, positions, RL logprobs and advantages); only the run id may
differ, since the input files' bytes and format are part of it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.conftest import EXAMPLES, tiny_tree
from trainer_core.config import config_from_dict
from trainer_core.run.plan import build_plan
from trainer_core.run.validate import validate_inputs

SFT = EXAMPLES / "tiny" / "sft.jsonl"
RL = EXAMPLES / "tiny" / "rl.jsonl"
RL_DATA = {"kind": "rl", "max_seq_len": 160}
# ShareGPT's speaker names for the roles of the example data (FastChat's and LLaMA-Factory's).
SHAREGPT_FROM = {"system": "system", "user": "human", "assistant": "gpt"}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def _sharegpt(record: dict) -> dict:
    return {"conversations": [{"from": SHAREGPT_FROM[m["role"]], "value": m["content"]} for m in record["messages"]]}


def _prompt_completion(record: dict) -> dict:
    *context, user, assistant = record["messages"]
    pair = {"prompt": user["content"], "completion": assistant["content"]}
    return pair | ({"system": context[0]["content"]} if context else {})


def _table(records: list[dict]) -> pa.Table:
    """The records as columns: every row has every top-level field, null where the record has none
    (pyarrow would take the columns from the first record alone)."""
    columns = list(dict.fromkeys(key for record in records for key in record))
    return pa.Table.from_pylist([{key: record.get(key) for key in columns} for record in records])


def _parquet(path: Path, records: list[dict]) -> Path:
    pq.write_table(_table(records), path)
    return path


def _arrow_file(path: Path, records: list[dict]) -> Path:
    table = _table(records)
    with pa.ipc.new_file(path, table.schema) as writer:
        writer.write_table(table, max_chunksize=100)  # several record batches
    return path


def _arrow_saved_by_datasets(directory: Path, records: list[dict]) -> str:
    datasets.Dataset.from_list(records).save_to_disk(str(directory))
    return str(directory / "*.arrow")  # the stream-format shards datasets writes


def _plan(tmp_path: Path, path, **data):
    config = config_from_dict(tiny_tree(tmp_path, data={"path": path, **data}), config_dir=tmp_path)
    plan, shards = build_plan(config)
    return plan, {index: dict(shards[index]) for index in shards}


def _assert_same_plan(candidate, reference) -> None:
    (plan, shards), (expected_plan, expected_shards) = candidate, reference
    assert plan.stage_digests == expected_plan.stage_digests
    assert plan.num_conversations == expected_plan.num_conversations
    assert sorted(shards) == sorted(expected_shards)
    for index, tensors in shards.items():
        assert sorted(tensors) == sorted(expected_shards[index])
        for name, tensor in tensors.items():
            expected = expected_shards[index][name]
            assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), (index, name)
    assert plan.run_id != expected_plan.run_id  # other bytes (or files, or format): another run


Writer = Callable[[Path, list[dict]], object]
SFT_CANDIDATES: dict[str, Writer] = {
    "messages-parquet": lambda d, r: _parquet(d / "sft.parquet", r),
    "messages-arrow-ipc-file": lambda d, r: _arrow_file(d / "sft.arrow", r),
    "messages-arrow-by-datasets": lambda d, r: _arrow_saved_by_datasets(d / "saved", r),
    "sharegpt-jsonl": lambda d, r: _write_jsonl(d / "sharegpt.jsonl", [_sharegpt(x) for x in r]),
    "sharegpt-parquet": lambda d, r: _parquet(d / "sharegpt.parquet", [_sharegpt(x) for x in r]),
    "messages-list-of-jsonl": lambda d, r: [
        _write_jsonl(d / f"{name}.jsonl", r[start : start + 500]) for name, start in (("b", 0), ("a", 500), ("c", 1000))
    ],
    "messages-glob-of-three-types": lambda d, r: (
        _write_jsonl(d / "part-0.jsonl", r[:400]),
        _parquet(d / "part-1.parquet", r[400:800]),
        _arrow_file(d / "part-2.arrow", r[800:]),
        d / "part-*",
    )[-1],
}


@pytest.fixture(scope="module")
def sft_reference(tmp_path_factory):
    return _plan(tmp_path_factory.mktemp("reference"), str(SFT))


@pytest.mark.parametrize("name", sorted(SFT_CANDIDATES))
def test_each_format_and_file_type_gives_the_jsonl_plan(name, sft_reference, tmp_path):
    written = SFT_CANDIDATES[name](tmp_path, _records(SFT))
    path = [str(p) for p in written] if isinstance(written, list) else str(written)
    _assert_same_plan(_plan(tmp_path, path), sft_reference)


def test_prompt_completion_pairs_give_the_plan_of_their_conversations(tmp_path):
    # The single-turn records (with or without a system prompt) are exactly what a pair can hold.
    single_turn = [r for r in _records(SFT) if [m["role"] for m in r["messages"]][-2:] == ["user", "assistant"]]
    single_turn = [r for r in single_turn if len(r["messages"]) <= 3]
    assert len(single_turn) > 900
    reference = _plan(tmp_path / "reference", str(_write_jsonl(tmp_path / "messages.jsonl", single_turn)))
    pairs = [_prompt_completion(r) for r in single_turn]
    _assert_same_plan(_plan(tmp_path / "jsonl", str(_write_jsonl(tmp_path / "pairs.jsonl", pairs))), reference)
    _assert_same_plan(_plan(tmp_path / "parquet", str(_parquet(tmp_path / "pairs.parquet", pairs))), reference)


@pytest.mark.parametrize("pack", [False, True])
def test_rl_trajectories_in_parquet_give_the_jsonl_plan(pack, tmp_path):
    reference = _plan(tmp_path / "reference", str(RL), **RL_DATA, pack=pack)
    candidate = _plan(tmp_path / "parquet", str(_parquet(tmp_path / "rl.parquet", _records(RL))), **RL_DATA, pack=pack)
    _assert_same_plan(candidate, reference)


def _checked(tmp_path: Path, path, **data):
    config = config_from_dict(tiny_tree(tmp_path, data={"path": path, **data}), config_dir=tmp_path)
    return config, validate_inputs(config)


def test_the_fingerprint_names_the_files_and_the_format_not_how_it_was_chosen(tmp_path):
    sharegpt = _write_jsonl(tmp_path / "sharegpt.jsonl", [_sharegpt(r) for r in _records(SFT)])
    detected_config, detected = _checked(tmp_path / "a", str(sharegpt))
    chosen_config, chosen = _checked(tmp_path / "b", str(sharegpt), format="sharegpt")
    assert detected.fingerprint == chosen.fingerprint
    assert detected.fingerprint["data_format"] == "sharegpt"
    _, plain = _checked(tmp_path / "c", str(SFT))
    assert "data_format" not in plain.fingerprint and isinstance(plain.fingerprint["data"], str)
    # The same run from the format's auto choice and from the config: one run id (each planned from its own checks).
    assert build_plan(detected_config, detected)[0].run_id == build_plan(chosen_config, chosen)[0].run_id


def test_the_file_set_and_its_order_are_part_of_the_run_id(tmp_path, sft_reference):
    records = _records(SFT)
    first, second = _write_jsonl(tmp_path / "1.jsonl", records[:600]), _write_jsonl(tmp_path / "2.jsonl", records[600:])
    whole = sft_reference[0]
    split = _plan(tmp_path / "split", [str(first), str(second)])[0]
    swapped = _plan(tmp_path / "swapped", [str(second), str(first)])[0]
    assert len({whole.run_id, split.run_id, swapped.run_id}) == 3
    assert split.stage_digests == whole.stage_digests and swapped.stage_digests != whole.stage_digests
