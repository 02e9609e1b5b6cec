"""Bad-input cases: the data's files (lists, globs, hub names, Parquet, Arrow) and formats (ShareGPT,
prompt/completion, a record or a file in another format than its file's or its data's)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..harness import Assets
from .common import GOOD_SFT, Case, data_section, directory

FIX_FILES = r"point (it|data\.path) at a JSONL file, or at Parquet or Arrow files"
GOOD_SHAREGPT = '{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}\n'
GOOD_PAIR = '{"prompt": "hi", "completion": "hello"}\n'
GOOD_ROW = json.loads(GOOD_SFT)


def _sharegpt(*turns: tuple[str, str], **fields) -> str:
    return json.dumps({"conversations": [{"from": who, "value": value} for who, value in turns], **fields}) + "\n"


def parquet(rows: list[dict], schema: pa.Schema | None = None):
    def build(target: Path, _: Assets) -> None:
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), target)

    return build


def arrow_stream(rows: list[dict], cut_bytes: int = 0):
    def build(target: Path, _: Assets) -> None:
        table = pa.Table.from_pylist(rows)
        with pa.ipc.new_stream(target, table.schema) as writer:
            writer.write_table(table)
        if cut_bytes:
            target.write_bytes(target.read_bytes()[:-cut_bytes])

    return build


def symlink_loop(target: Path, _: Assets) -> None:
    os.symlink(target.name, target)


def _columnar_case(name: str, file: str, builder, where: str, fix: str, **data) -> Case:
    return Case(
        name, "data-record", where, fix, files={file: builder}, config={"data": {"path": f"{{dir}}/{file}", **data}}
    )


_EMPTY_MESSAGES = pa.schema([("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))])

CASES: list[Case] = [
    # Which files: globs, lists, names that are not local files.
    Case(
        "data_glob_matches_nothing",
        "data-file",
        r"data\.path='{dir}/shards/\*\.parquet' matches no file",
        FIX_FILES,
        files={"shards": directory},
        config={"data": {"path": "shards/*.parquet"}},
    ),
    Case(
        "data_hub_name",
        "data-file",
        r"data\.path='{dir}/HuggingFaceH4/ultrachat_200k' does not exist",
        r"hf download HuggingFaceH4/ultrachat_200k --repo-type dataset --local-dir DIR",
        config={"data": {"path": "HuggingFaceH4/ultrachat_200k"}},
    ),
    Case(
        "data_hub_url",
        "data-file",
        r"data\.path='hf://datasets/HuggingFaceH4/ultrachat_200k' is a URL of the Hugging Face hub",
        r"download the data first",
        config={"data": {"path": "hf://datasets/HuggingFaceH4/ultrachat_200k"}},
    ),
    Case(
        "data_symlink_loop",
        "data-file",
        r"data\.path='{dir}/loop\.jsonl' is a symbolic link that loops",
        FIX_FILES,
        files={"loop.jsonl": symlink_loop},
        config={"data": {"path": "loop.jsonl"}},
    ),
    Case(
        "data_list_holds_a_directory",
        "data-file",
        r"data\.path='{dir}/more': is a directory, not a regular file",
        FIX_FILES,
        files={"a.jsonl": GOOD_SFT, "more": directory},
        config={"data": {"path": ["a.jsonl", "more"]}},
    ),
    Case(
        "data_list_empty",
        "config-value",
        r"data\.path",
        r"at least 1 item",
        config={"data": {"path": []}},
    ),
    Case(
        "data_list_holds_an_empty_file",
        "data-file",
        r"{dir}/b\.jsonl: no conversations found",
        r"add records to it, or leave it out of data\.path",
        files={"a.jsonl": GOOD_SFT, "b.jsonl": ""},
        config={"data": {"path": ["a.jsonl", "b.jsonl"]}},
    ),
    # Formats: one file, one format; the data, one format.
    Case(
        "data_formats_mixed_across_files",
        "data-record",
        r"{dir}/b\.jsonl:1: a ShareGPT record, but {dir}/a\.jsonl:1 is a messages record",
        r"the files of data\.path share one format: convert one of them",
        files={"a.jsonl": GOOD_SFT, "b.jsonl": GOOD_SHAREGPT},
        config={"data": {"path": "*.jsonl"}},
    ),
    Case(
        "data_format_changes_within_a_file",
        "data-record",
        r"{dir}/data\.jsonl:2: field conversations: a ShareGPT record in a messages file \(its first record, "
        r"{dir}/data\.jsonl:1, is messages\)",
        r"one file holds one format: convert this record",
        **data_section(GOOD_SFT, GOOD_SHAREGPT),
    ),
    Case(
        "data_format_set_to_another",
        "data-record",
        r"{dir}/data\.jsonl:1: field messages: a messages record in a ShareGPT file \(data\.format='sharegpt'\)",
        r"set data\.format='auto' \(or 'messages'\)",
        **data_section(GOOD_SFT, format="sharegpt"),
    ),
    # ShareGPT records.
    Case(
        "sharegpt_unknown_role",
        "data-record",
        r"{dir}/data\.jsonl:2: field conversations\.1\.from: Input should be 'human', 'user', 'gpt'",
        r"use one of those",
        **data_section(GOOD_SHAREGPT, _sharegpt(("human", "hi"), ("bing", "hello"))),
    ),
    Case(
        "sharegpt_missing_value",
        "data-record",
        r"{dir}/data\.jsonl:2: field conversations\.1\.value: Field required",
        r"add it",
        **data_section(GOOD_SHAREGPT, '{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt"}]}\n'),
    ),
    Case(
        "sharegpt_function_call_not_json",
        "data-record",
        r"{dir}/data\.jsonl:2: field conversations\.1\.value: not valid JSON",
        r'give JSON \{"name": NAME, "arguments": \{…\}\}',
        **data_section(GOOD_SHAREGPT, _sharegpt(("human", "hi"), ("function_call", "get_weather(Paris)"))),
    ),
    Case(
        "sharegpt_function_call_lone_surrogate",  # escaped twice: the line's own check sees only text
        "data-record",
        r"{dir}/data\.jsonl:2: field conversations\.1\.value: the call's arguments\.x holds a lone UTF-16 surrogate",
        r"fix the escape",
        **data_section(
            GOOD_SHAREGPT,
            _sharegpt(
                ("human", "hi"), ("function_call", '{"name": "f", "arguments": {"x": "\\ud800"}}'), ("gpt", "ok")
            ),
        ),
    ),
    Case(
        "sharegpt_function_call_nan",
        "data-record",
        r"{dir}/data\.jsonl:2: field conversations\.1\.value: not valid JSON",
        r'give JSON \{"name": NAME',
        **data_section(
            GOOD_SHAREGPT,
            _sharegpt(("human", "hi"), ("function_call", '{"name": "f", "arguments": {"x": NaN}}'), ("gpt", "ok")),
        ),
    ),
    Case(
        "sharegpt_function_call_without_name",
        "data-record",
        r"{dir}/data\.jsonl:2: field conversations\.1\.value: not a call \(field name: Field required",
        r'give JSON \{"name": NAME',
        **data_section(GOOD_SHAREGPT, _sharegpt(("human", "hi"), ("function_call", '{"arguments": {}}'))),
    ),
    Case(
        "sharegpt_tools",
        "data-record",
        r"{dir}/data\.jsonl:2: field tools: tool descriptions are not rendered",
        r"describe the tools in the system prompt",
        **data_section(GOOD_SHAREGPT, _sharegpt(("human", "hi"), ("gpt", "hello"), tools="[]")),
    ),
    Case(
        "sharegpt_rl_fields",
        "data-record",
        r"{dir}/data\.jsonl:1: field reward: RL trajectories are read in the messages format only",
        r'write this record as \{"messages": \[\.\.\.\], \.\.\.\}',
        **data_section(_sharegpt(("human", "hi"), ("gpt", "hello"), reward=1.0, group_id="g"), kind="rl"),
    ),
    Case(
        "sharegpt_no_gpt_turn",
        "data-record",
        r"{dir}/data\.jsonl:2: field conversations: no turn from 'gpt'",
        r"add one or remove the record",
        **data_section(GOOD_SHAREGPT, _sharegpt(("human", "hi"), ("human", "anyone?"))),
    ),
    # prompt/completion records.
    Case(
        "prompt_completion_wrong_type",
        "data-record",
        r"{dir}/data\.jsonl:2: field completion: Input should be a valid string \(got 5\)",
        r"fix the value",
        **data_section(GOOD_PAIR, '{"prompt": "hi", "completion": 5}\n'),
    ),
    Case(
        "prompt_completion_missing_completion",
        "data-record",
        r"{dir}/data\.jsonl:2: field completion: Field required",
        r"add it",
        **data_section(GOOD_PAIR, '{"prompt": "hi"}\n'),
    ),
    Case(
        "prompt_completion_as_messages",
        "data-record",
        r"{dir}/data\.jsonl:1: field prompt: a list of messages",
        r'write \{"messages": prompt \+ completion\} instead',
        **data_section('{"prompt": [{"role": "user", "content": "hi"}], "completion": "hello"}\n'),
    ),
    # Parquet and Arrow files.
    _columnar_case(
        "parquet_not_parquet",
        "data.parquet",
        GOOD_SFT,
        r"{dir}/data\.parquet: not a readable Parquet file \(ArrowInvalid",
        r"rewrite it, or point data\.path at",
    ),
    _columnar_case(
        "parquet_empty",
        "data.parquet",
        parquet([], schema=_EMPTY_MESSAGES),
        r"{dir}/data\.parquet: no conversations found",
        r"add records to it, or leave it out of data\.path",
    ),
    _columnar_case(
        "parquet_null_content",
        "data.parquet",
        parquet([GOOD_ROW, {"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}]),
        r"{dir}/data\.parquet:row 1: field messages\.0: content: null is allowed only",
        r"give a string",
    ),
    _columnar_case(
        "parquet_wrong_column_type",
        "data.parquet",
        parquet([{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": 6}]}]),
        r"{dir}/data\.parquet:row 0: field messages\.0\.content: Input should be a valid string \(got 5\)",
        r"fix the value",
    ),
    _columnar_case(
        "parquet_rl_without_logprobs",
        "data.parquet",
        parquet([GOOD_ROW | {"reward": 1.0, "group_id": "g", "policy_version": 0}]),
        r"{dir}/data\.parquet:row 0: field messages\.1\.logprobs: required on every message that carries loss",
        r"add them or set train=false",
        kind="rl",
    ),
    _columnar_case(
        "arrow_cut_short",
        "data.arrow",
        arrow_stream([GOOD_ROW] * 4, cut_bytes=40),
        r"{dir}/data\.arrow: not a readable Arrow \(IPC stream or file\) file",
        r"rewrite it, or point data\.path at",
    ),
    _columnar_case(
        "arrow_sharegpt_unknown_role",
        "data.arrow",
        arrow_stream([json.loads(GOOD_SHAREGPT)] * 2 + [json.loads(_sharegpt(("bing", "hi"), ("gpt", "hello")))]),
        r"{dir}/data\.arrow:row 2: field conversations\.0\.from: Input should be 'human'",
        r"use one of those",
    ),
]
