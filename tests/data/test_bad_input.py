"""A corpus of bad files: each fails the plan with FILE:LINE and the field, before anything is written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import tiny_tree
from trainer_core.config import config_from_dict
from trainer_core.data import DataError
from trainer_core.run.plan import build_plan

BAD = Path(__file__).resolve().parent / "bad"

# file -> (line, what the message must say after "FILE:LINE: ")
CORPUS = {
    "malformed_json": (2, r"not valid JSON"),
    "missing_field": (2, r"field messages\.1\.content: Field required"),
    "unknown_role": (
        2,
        r"field messages\.0\.role: Input should be 'system', 'user', 'assistant' or 'tool' \(got 'wizard'\)",
    ),
    "empty_conversation": (2, r"field messages: List should have at least 1 item"),
    "no_assistant": (2, r"field messages: no assistant message"),
    "unknown_field": (2, r"field rewrd: unknown field"),
    "logprob_count": (2, r"field messages\.1\.logprobs: 3 logprobs for 4 loss tokens"),
    "token_mismatch": (2, r"field messages\.1\.token_ids: token 0 is 5 in the data but \d+ after tokenization"),
    "nonfinite_reward": (2, r"field reward: .*finite"),
    "infinite_logprob": (2, r"field messages\.1\.logprobs\.3: .*finite"),
    "positive_logprob": (2, r"field messages\.1\.logprobs\.3: Input should be less than or equal to 0"),
    "reward_without_group": (2, r"field group_id: a reward without an advantage needs a group_id"),
    "missing_policy_version": (2, r"field policy_version: required for an RL trajectory"),
    "missing_logprobs": (2, r"field messages\.1\.logprobs: required on every message that carries loss"),
    "mixed_kinds": (2, r"field reward: .*:1 is an RL trajectory .* but this record is not"),
    "too_long": (2, r"field messages: \d+ tokens, over data\.max_seq_len=128"),
    "tool_calls_on_user": (2, r"field messages\.0: tool_calls: only assistant messages make tool calls"),
    "null_content": (2, r"field messages\.0: content: null is allowed only for an assistant message with tool_calls"),
    "not_an_object": (2, r"expected a JSON object"),
}


def test_the_corpus_covers_every_file():
    assert sorted([*CORPUS, "empty_file"]) == sorted(p.stem for p in BAD.glob("*.jsonl"))


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_bad_file_fails_the_plan_naming_file_line_and_field(tmp_path, name):
    line, message = CORPUS[name]
    path = BAD / f"{name}.jsonl"
    config = config_from_dict(tiny_tree(tmp_path, data={"path": str(path)}), config_dir=tmp_path)
    with pytest.raises(DataError, match=rf"^{path}:{line}: {message}"):
        build_plan(config)
    assert not (tmp_path / "work").exists()


def test_empty_file_is_an_error(tmp_path):
    config = config_from_dict(tiny_tree(tmp_path, data={"path": str(BAD / "empty_file.jsonl")}), config_dir=tmp_path)
    with pytest.raises(DataError, match="no conversations found"):
        build_plan(config)


def test_too_long_is_a_counted_skip_under_truncate_or_drop(tmp_path):
    path = str(BAD / "too_long.jsonl")
    for overflow, truncated, dropped in (("truncate", 0, 1), ("drop", 0, 1)):
        # The long record's only loss tokens sit past the limit: truncating it leaves nothing to learn, so it is dropped.
        config = config_from_dict(tiny_tree(tmp_path, data={"path": path, "overflow": overflow}), config_dir=tmp_path)
        plan, _ = build_plan(config)
        assert (plan.num_conversations, plan.num_truncated, plan.num_dropped) == (2, truncated, dropped)


def _write_toml(path: Path, tree: dict) -> Path:
    path.write_text(
        "\n".join(
            f"[{section}]\n" + "\n".join(f"{key} = {json.dumps(value)}" for key, value in values.items())
            for section, values in tree.items()
        )
    )
    return path


# `rankflow run` on each file in one fresh process (one temporary Prefect API for
# all of them, and no Prefect log handler left pointing at a closed pytest capture).
_CLI_WORKER = """
import contextlib, io, json, sys
from flows.cli import main
results = {}
for name, config in json.loads(sys.argv[1]).items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["run", config])
    results[name] = {"code": code, "stderr": err.getvalue()}
print("RESULTS " + json.dumps(results))
"""
CLI_CASES = [
    "malformed_json",
    "unknown_role",
    "empty_conversation",
    "logprob_count",
    "token_mismatch",
    "nonfinite_reward",
    "too_long",
    "mixed_kinds",
]


@pytest.mark.flow
def test_rankflow_run_exits_2_and_writes_nothing(tmp_path):
    configs = {}
    for name in CLI_CASES:
        case_dir = tmp_path / name
        case_dir.mkdir()
        configs[name] = str(
            _write_toml(case_dir / "run.toml", tiny_tree(case_dir, data={"path": str(BAD / f"{name}.jsonl")}))
        )
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    }
    done = subprocess.run(
        [sys.executable, "-c", _CLI_WORKER, json.dumps(configs)],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert lines, f"the worker failed:\n{done.stderr[-3000:]}"
    results = json.loads(lines[-1].removeprefix("RESULTS "))
    for name in CLI_CASES:
        line, message = CORPUS[name]
        path = BAD / f"{name}.jsonl"
        assert results[name]["code"] == 2, (name, results[name])
        assert re.search(rf"rankflow: bad input: {re.escape(str(path))}:{line}: {message}", results[name]["stderr"]), (
            name,
            results[name],
        )
        assert not (tmp_path / name / "work").exists() and not (tmp_path / name / "store").exists()
