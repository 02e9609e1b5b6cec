"""Each format's records against a reference written by hand: the tokens a pair trains on, the messages a
ShareGPT record means, and where a record of Parquet or Arrow is named.

- prompt/completion: the loss covers exactly the completion's tokens and the end-of-turn token after it, found
  here by encoding the ChatML pieces with the tokenizer directly (not through the pipeline's render or mask);
- ShareGPT: every role LLaMA-Factory and FastChat write (function_call and observation included) gives the
  OpenAI messages record written out by hand;
- a bad row of a Parquet or Arrow file is named by its row index, counted from 0 as pyarrow counts.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import EXAMPLES
from trainer_core.data import DataError, DataOptions, load_tokenizer, prepare, read_conversations, read_records
from trainer_core.data.schema import Conversation

TOKENIZER = EXAMPLES / "tiny" / "tokenizer.json"

PAIRS = [
    {"prompt": "What is 2 plus 2?", "completion": "2 plus 2 is 4."},
    {"prompt": "Name a colour.", "completion": " Blue, with a leading space.", "system": "Answer briefly."},
    {"prompt": "Say nothing.", "completion": ""},
]


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids if text else []


@pytest.mark.parametrize("index", range(len(PAIRS)))
def test_a_pair_trains_on_exactly_its_completion(index, tmp_path):
    pair = PAIRS[index]
    tokenizer = load_tokenizer(TOKENIZER)
    (document,) = prepare(
        read_records(_write_jsonl(tmp_path / "pairs.jsonl", [pair])), tokenizer, None, DataOptions(max_seq_len=512)
    ).documents
    system = f"<|im_start|>system\n{pair['system']}<|im_end|>\n" if "system" in pair else ""
    prompt = f"{system}<|im_start|>user\n{pair['prompt']}<|im_end|>\n<|im_start|>assistant\n"
    # Inference encodes the prompt, then samples the completion and its end-of-turn token after it.
    context, completion, after = (
        _encode(tokenizer, prompt),
        _encode(tokenizer, pair["completion"] + "<|im_end|>"),
        _encode(tokenizer, "\n"),
    )
    assert document.input_ids.tolist() == context + completion + after
    expected_mask = np.array([False] * len(context) + [True] * len(completion) + [False] * len(after))
    np.testing.assert_array_equal(document.loss_mask, expected_mask)


def test_sharegpt_roles_give_the_messages_written_by_hand(tmp_path):
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    sharegpt = {
        "system": "You can call tools.",
        "conversations": [
            {"from": "human", "value": "Weather in Paris?"},
            {"from": "function_call", "value": json.dumps(call)},
            {"from": "observation", "value": '{"celsius": 21}'},
            {"from": "gpt", "value": "It is 21 degrees."},
            {"from": "user", "value": "And both cities?"},
            {"from": "function_call", "value": json.dumps([call, {"name": "get_weather", "arguments": "{}"}])},
            {"from": "tool", "value": "[21, 19]"},
            {"from": "assistant", "value": "21 and 19."},
        ],
        "id": "weather-1",
    }
    function = {"type": "function", "function": call}
    by_hand = {
        "messages": [
            {"role": "system", "content": "You can call tools."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [function]},
            {"role": "tool", "content": '{"celsius": 21}'},
            {"role": "assistant", "content": "It is 21 degrees."},
            {"role": "user", "content": "And both cities?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [function, {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}],
            },
            {"role": "tool", "content": "[21, 19]"},
            {"role": "assistant", "content": "21 and 19."},
        ],
        "id": "weather-1",
    }
    (converted,) = read_conversations(_write_jsonl(tmp_path / "sharegpt.jsonl", [sharegpt]))
    assert converted == Conversation.model_validate(by_hand)


def _bad_rows() -> list[dict]:
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "hello"}]}
    return [good, good, good, bad, good]


def test_a_bad_parquet_row_is_named_by_its_index(tmp_path):
    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(_bad_rows()), path, row_group_size=2)  # the bad row in the second group
    assert pq.read_table(path).slice(3, 1).to_pylist()[0]["messages"][1]["role"] == "wizard"
    with pytest.raises(DataError, match=rf"^{path}:row 3: field messages\.1\.role: Input should be"):
        read_records(path)


def test_a_bad_arrow_row_is_named_by_its_index(tmp_path):
    path = tmp_path / "data.arrow"
    table = pa.Table.from_pylist(_bad_rows())
    with pa.ipc.new_stream(path, table.schema) as writer:
        writer.write_table(table, max_chunksize=3)  # the bad row in the second batch
    with pytest.raises(DataError, match=rf"^{path}:row 3: field messages\.1\.role: Input should be"):
        read_records(path)
