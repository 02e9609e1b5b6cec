"""Bad-input cases: the data file."""

from __future__ import annotations

import json

from .common import DEEP, GOOD_RL, GOOD_SFT, SURROGATE, Case, data_section, directory, fifo

CASES: list[Case] = [
    Case(
        "data_missing",
        "data-file",
        r"data\.path='{dir}/nope\.jsonl' does not exist",
        r"point it at a JSONL file",
        config={"data": {"path": "{dir}/nope.jsonl"}},
    ),
    Case(
        "data_is_directory",
        "data-file",
        r"data\.path='{dir}/data': is a directory, not a regular file",
        r"point data\.path at a JSONL file",
        files={"data": directory},
        config={"data": {"path": "{dir}/data"}},
    ),
    Case(
        "data_is_fifo",
        "data-file",
        r"data\.path='{dir}/data\.jsonl': is a FIFO \(named pipe\), not a regular file",
        r"point data\.path at a JSONL file",
        files={"data.jsonl": fifo},
        config={"data": {"path": "{dir}/data.jsonl"}},
    ),
    Case(
        "data_is_a_device",
        "data-file",
        r"data\.path='/dev/null': is a character device",
        r"point data\.path at a JSONL file",
        config={"data": {"path": "/dev/null"}},
    ),
    # /proc/self/mem is a regular file whose every read fails with EIO (as a dying disk or a broken network mount does).
    Case(
        "data_read_fails_eio",
        "data-file",
        r"data\.path='/proc/(self|\d+)/mem': cannot be read \(Input/output error\)",
        r"point data\.path at a JSONL file",
        config={"data": {"path": "/proc/self/mem"}},
    ),
    Case(
        "data_empty",
        "data-file",
        r"{bad}/empty_file\.jsonl: no conversations found",
        r"add records to it, or leave it out of data\.path",
        config={"data": {"path": "{bad}/empty_file.jsonl"}},
    ),
    Case(
        "data_blank_lines_only",
        "data-file",
        r"{dir}/data\.jsonl: no conversations found",
        r"add records to it, or leave it out of data\.path",
        **data_section("\n", "   \n", "\n"),
    ),
    Case(
        "data_not_utf8",
        "data-record",
        r"{dir}/data\.jsonl:2: not UTF-8 text \(byte 0xff at column 44\)",
        r"save the file as UTF-8",
        files={"data.jsonl": GOOD_SFT.encode() + b'{"messages": [{"role": "user", "content": "\xff"}]}\n'},
        config={"data": {"path": "{dir}/data.jsonl"}},
    ),
    Case(
        "data_lone_surrogate",
        "data-record",
        r"{dir}/data\.jsonl:2: field messages\.0\.content: holds a lone UTF-16 surrogate",
        r"fix the escape",
        **data_section(GOOD_SFT, SURROGATE),
    ),
    Case(
        "data_deeply_nested",
        "data-record",
        r"{dir}/data\.jsonl:2: not valid JSON \(nested too deeply",
        r"each line must be one JSON object",
        **data_section(GOOD_SFT, DEEP),
    ),
    Case(
        "data_token_id_past_int64",
        "data-record",
        r"{dir}/data\.jsonl:2: field messages\.1\.token_ids\.0: Input should be less than or equal to 9223372036854775807",
        r"token ids index the tokenizer's vocabulary",
        **data_section(
            GOOD_RL,
            GOOD_RL.replace('"logprobs"', '"token_ids": [99999999999999999999999, 1, 2, 3], "logprobs"'),
            kind="rl",
        ),
    ),
    Case(
        "data_policy_version_past_int64",
        "data-record",
        r"{dir}/data\.jsonl:2: field policy_version: Input should be less than or equal to 9223372036854775807",
        r"give the \(non-negative\) version",
        **data_section(
            GOOD_RL, GOOD_RL.replace('"policy_version": 0', '"policy_version": 99999999999999999999'), kind="rl"
        ),
    ),
    Case(
        "data_reward_past_float",
        "data-record",
        r"{dir}/data\.jsonl:2: field reward: Input should be a finite number",
        r"must be finite",
        **data_section(GOOD_RL, GOOD_RL.replace('"reward": 1.0', '"reward": 1e400'), kind="rl"),
    ),
    Case(
        "data_nan_literal",
        "data-record",
        r"{dir}/data\.jsonl:2: field advantage: Input should be a finite number \(got nan\)",
        r"must be finite",
        **data_section(GOOD_RL, GOOD_RL.replace('"reward": 1.0, "group_id": "g"', '"advantage": NaN'), kind="rl"),
    ),
    Case(
        "data_wrong_type",
        "data-record",
        r"{dir}/data\.jsonl:2: field messages\.0\.content: Input should be a valid string",
        r"fix the value",
        **data_section(
            GOOD_SFT, '{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}\n'
        ),
    ),
    Case(
        "data_kind_rl_on_sft_records",
        "data-record",
        r"{tiny}/sft\.jsonl: data\.kind='rl' but the records carry no reward",
        r"set data\.kind='sft'",
        config={"data": {"kind": "rl"}},
    ),
    Case(
        "data_kind_sft_on_rl_records",
        "data-record",
        r"{tiny}/rl\.jsonl: the records are RL trajectories .* but data\.kind='sft'",
        r"set data\.kind='rl'",
        config={"data": {"path": "{tiny}/rl.jsonl", "max_seq_len": 160}},
    ),
    Case(
        "data_nothing_left_after_drop",
        "data-record",
        r"{dir}/data\.jsonl: no conversation left with loss tokens",
        r"raise data\.max_seq_len \(the shortest conversation has \d+ tokens\)",
        **data_section(
            '{"messages": [{"role": "user", "content": "'
            + "word " * 40
            + '"}, {"role": "assistant", "content": "ok"}]}\n',
            max_seq_len=16,
            overflow="drop",
        ),
    ),
    Case(  # issue 31: a later stage's error named the field `messages`, which a ShareGPT file does not have
        "sharegpt_too_long",
        "data-record",
        r"{dir}/data\.jsonl:2: field conversations: \d+ tokens, over data\.max_seq_len=16",
        r"raise max_seq_len or set data\.overflow",
        **data_section(
            '{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}\n',
            json.dumps({"conversations": [{"from": "human", "value": "word " * 40}, {"from": "gpt", "value": "ok"}]})
            + "\n",
            max_seq_len=16,
        ),
    ),
]
