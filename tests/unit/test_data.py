"""Conversation records, rendering and the loss mask."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import EXAMPLES
from trainer_core.data import Conversation, DataError, load_tokenizer, mask, read_conversations, render_chatml, tokenize


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", r"bad\.jsonl:2: not valid JSON"),
        (json.dumps({"messages": []}), r"bad\.jsonl:2: field messages: List should have at least 1 item"),
        (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), r"bad\.jsonl:2: field messages\.0\.role"),
        (json.dumps({"messages": [{"role": "user"}]}), r"bad\.jsonl:2: field messages\.0\.content: Field required"),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}]}),
            r"bad\.jsonl:2: field messages: no assistant message",
        ),
        (
            json.dumps({"msgs": []}),
            r"bad\.jsonl:2: field messages: Field required; add it .*; field msgs: unknown field; remove it",
        ),
        ("[1, 2]", r"bad\.jsonl:2: expected a JSON object"),
    ],
)
def test_bad_records_name_file_line_and_field(tmp_path, line, expected):
    path = write_lines(tmp_path / "bad.jsonl", [GOOD, line])
    with pytest.raises(DataError, match=expected):
        read_conversations(path)


def test_empty_file_is_an_error(tmp_path):
    with pytest.raises(DataError, match="no conversations found"):
        read_conversations(write_lines(tmp_path / "empty.jsonl", [""]))


def test_mask_selects_exactly_the_assistant_replies():
    tokenizer = load_tokenizer(EXAMPLES / "tiny" / "tokenizer.json")
    conversation = Conversation.model_validate(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2 plus 3?"},
                {"role": "assistant", "content": "2 plus 3 is 5."},
                {"role": "user", "content": "And 4 plus 4?"},
                {"role": "assistant", "content": "4 plus 4 is 8."},
            ]
        }
    )
    rendered = render_chatml(conversation)
    (tokenized,) = tokenize(tokenizer, [rendered])
    seq = mask(tokenized, rendered)
    assert tokenizer.decode(seq.input_ids.tolist(), skip_special_tokens=False) == rendered.text
    masked = seq.input_ids[seq.loss_mask].tolist()
    # The masked tokens are the two replies, each closed by <|im_end|>, and nothing else.
    im_end = tokenizer.token_to_id("<|im_end|>")
    pieces, current = [], []
    for token in masked:
        current.append(token)
        if token == im_end:
            pieces.append(tokenizer.decode(current, skip_special_tokens=False))
            current = []
    assert pieces == ["2 plus 3 is 5.<|im_end|>", "4 plus 4 is 8.<|im_end|>"] and not current


def test_example_data_is_valid_and_every_conversation_carries_loss():
    conversations = read_conversations(EXAMPLES / "tiny" / "sft.jsonl")
    tokenizer = load_tokenizer(EXAMPLES / "tiny" / "tokenizer.json")
    rendered = [render_chatml(c) for c in conversations]
    sequences = [mask(t, r) for t, r in zip(tokenize(tokenizer, rendered), rendered)]
    assert len(sequences) == len(conversations) > 1000
    assert all(np.any(s.loss_mask) for s in sequences)
