"""Bad-input cases: the data corpus of tests/data/bad (one bad record each), through the CLI too."""

from __future__ import annotations

from .common import Case

CASES: list[Case] = []


# The data corpus of tests/data/bad (one bad record each), through the CLI too. RL files run as data.kind='rl'.
_RL_FILES = {
    "logprob_count",
    "token_mismatch",
    "nonfinite_reward",
    "infinite_logprob",
    "positive_logprob",
    "reward_without_group",
    "missing_policy_version",
    "missing_logprobs",
}
_DATA_FIXES = {
    "malformed_json": r"each line must be one JSON object",
    "missing_field": r"add it",
    "unknown_role": r"use one of those",
    "empty_conversation": r"give at least one message",
    "no_assistant": r"add one or remove the line",
    "unknown_field": r"remove it or fix its spelling \(did you mean 'reward'\?\)",
    "logprob_count": r"recompute logprobs with the same tokenizer and template",
    "token_mismatch": r"the behaviour policy used a different tokenizer or template",
    "nonfinite_reward": r"must be finite",
    "infinite_logprob": r"must be finite",
    "positive_logprob": r"a logprob is the log of a probability, so it is at most 0",
    "reward_without_group": r"add group_id or advantage",
    "missing_policy_version": r"give the version of the policy that sampled it",
    "missing_logprobs": r"add them or set train=false",
    "mixed_kinds": r"split the file or complete this record",
    "too_long": r"raise max_seq_len or set data\.overflow",
    "tool_calls_on_user": r"move them to the assistant message that makes them",
    "null_content": r"give a string",
    "not_an_object": r"write each line as \{\"messages\": ",
}
for _name, _fix in _DATA_FIXES.items():
    CASES.append(
        Case(
            f"record_{_name}",
            "data-record",
            rf"{{bad}}/{_name}\.jsonl:2: ",
            _fix,
            config={"data": {"path": f"{{bad}}/{_name}.jsonl", "kind": "rl" if _name in _RL_FILES else "sft"}},
        )
    )
