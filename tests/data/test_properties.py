"""Property tests on random conversations: the stages keep the text, and the masks
select exactly the tokens of the messages that carry loss."""

from __future__ import annotations

from functools import cache

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import EXAMPLES
from trainer_core.data import (
    CHATML_TEMPLATE,
    Aligned,
    Conversation,
    assign_rows,
    group_relative_advantages,
    layout_rows,
    load_tokenizer,
    mask,
    render_chatml,
    render_with_template,
    tokenize,
)

SETTINGS = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

# Any text, including whitespace at the edges and non-ASCII, but not the
# template's own markers (content that spells a special token is a different conversation).
text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40).filter(lambda s: "<|" not in s)
tool_call = st.builds(
    lambda name, args: {"type": "function", "function": {"name": name, "arguments": args}},
    st.text("abcdefgh_", min_size=1, max_size=8),
    st.one_of(st.dictionaries(st.text("xyz", min_size=1, max_size=3), st.integers(-5, 5), max_size=2), text),
)


@st.composite
def conversations(draw) -> Conversation:
    messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(text)})
    for _ in range(draw(st.integers(1, 3))):
        messages.append({"role": "user", "content": draw(text), "train": draw(st.sampled_from([None, None, True]))})
        calls = draw(st.lists(tool_call, max_size=2))
        if calls:
            messages.append({"role": "assistant", "content": draw(st.one_of(st.none(), text)), "tool_calls": calls})
            messages.extend({"role": "tool", "content": draw(text)} for _ in calls)
        messages.append(
            {"role": "assistant", "content": draw(text), "train": draw(st.sampled_from([None, None, False]))}
        )
    if not any(m.get("train") is not False and m["role"] == "assistant" or m.get("train") for m in messages):
        messages[-1]["train"] = True
    return Conversation.model_validate({"messages": messages})


@cache
def _tokenizer():
    return load_tokenizer(EXAMPLES / "tiny" / "tokenizer.json")


def _pieces(tokenizer, ids) -> str:
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


@SETTINGS
@given(conversations())
def test_render_then_tokenize_round_trips_the_text(conversation):
    rendered = render_chatml(conversation)
    (tokenized,) = tokenize(_tokenizer(), [rendered])
    assert _pieces(_tokenizer(), tokenized.input_ids) == rendered.text
    # offsets tile the text in order (byte-level tokens of one character share its range)
    starts, ends = tokenized.offsets[:, 0], tokenized.offsets[:, 1]
    assert starts[0] == 0 and ends[-1] == len(rendered.text) and (starts[1:] <= ends[:-1]).all()


@SETTINGS
@given(conversations())
def test_masks_select_exactly_the_tokens_of_the_messages_that_carry_loss(conversation):
    rendered = render_chatml(conversation)
    (tokenized,) = tokenize(_tokenizer(), [rendered])
    masked = mask(tokenized, rendered)
    loss_messages = [i for i, m in enumerate(conversation.messages) if m.carries_loss]
    assert list(rendered.span_messages) == loss_messages
    for (start, end), index in zip(rendered.loss_spans, rendered.span_messages):
        message = conversation.messages[index]
        expected = rendered.text[start:end]
        assert expected.endswith("<|im_end|>") and expected.startswith(message.content or "")
        assert _pieces(_tokenizer(), masked.input_ids[masked.message_index == index]) == expected
    # and nothing else: the tokens without loss are exactly the rest of the text
    rest = "".join(
        rendered.text[a:b]
        for a, b in zip(
            [0, *[e for _, e in rendered.loss_spans]], [*[s for s, _ in rendered.loss_spans], len(rendered.text)]
        )
    )
    assert _pieces(_tokenizer(), masked.input_ids[~masked.loss_mask]) == rest


@SETTINGS
@given(conversations())
def test_the_exported_jinja_template_renders_and_masks_like_the_default(conversation):
    assert render_with_template(conversation, CHATML_TEMPLATE) == render_chatml(conversation)


@SETTINGS
@given(st.lists(st.integers(1, 32), min_size=1, max_size=40), st.integers(1, 4), st.integers(32, 80))
def test_first_fit_keeps_order_capacity_and_uses_a_prefix(lengths, num_rows, row_len):
    rows, used = assign_rows(lengths, num_rows, row_len)
    placed = sorted(i for row in rows for i in row)
    assert placed == list(range(used)) and used >= 1
    assert all(sum(lengths[i] for i in row) <= row_len for row in rows)
    assert all(row == sorted(row) for row in rows)
    if used < len(lengths):  # it stopped because the next document fits no row
        assert all(sum(lengths[i] for i in row) + lengths[used] > row_len for row in rows)
    documents = [Aligned(input_ids=np.arange(n, dtype=np.int64) + 3, loss_mask=np.ones(n, dtype=bool)) for n in lengths]
    laid = layout_rows(documents, rows, row_len, pad_id=0)
    for r, row in enumerate(rows):
        for number, i in enumerate(row, start=1):
            where = laid.document_ids[r] == number
            assert (laid.input_ids[r][where] == documents[i].input_ids).all()
            assert (laid.position_ids[r][where] == np.arange(lengths[i])).all()
            assert not laid.loss_mask[r][where][0] and laid.loss_mask[r][where][1:].all()
    assert (laid.attention_mask == (laid.document_ids > 0)).all()


@SETTINGS
@given(st.lists(st.tuples(st.floats(-10, 10), st.sampled_from("abc")), min_size=1, max_size=30))
def test_group_relative_advantages_are_centred_and_scaled_per_group(pairs):
    rewards, groups = zip(*pairs)
    advantages = group_relative_advantages(rewards, groups)
    for group in set(groups):
        members = np.asarray([g == group for g in groups])
        values = np.asarray(rewards)[members]
        assert abs(advantages[members].mean()) < 1e-6
        expected = (values - values.mean()) / (values.std() + 1e-6)
        np.testing.assert_allclose(advantages[members], expected, rtol=1e-9, atol=1e-9)
