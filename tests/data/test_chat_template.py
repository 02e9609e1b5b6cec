"""A tokenizer directory with its own Jinja chat template: the plan renders with it."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import PreTrainedTokenizerFast

from tests.conftest import EXAMPLES, tiny_tree
from tests.golden.harness import CASES_DIR
from trainer_core.config import config_from_dict
from trainer_core.data import (
    DataError,
    load_chat_template,
    load_tokenizer,
    mask,
    read_conversations,
    render_with_template,
    tokenize,
)
from trainer_core.run.plan import build_plan

TEMPLATE = (CASES_DIR / "chat_template.jinja").read_text()
# ChatML with transformers' {% generation %} markers around what the assistant produces.
GENERATION_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tokenizer_dir(tmp_path, template: str, as_file: bool = False):
    directory = tmp_path / "tokenizer"
    directory.mkdir()
    shutil.copy(EXAMPLES / "tiny" / "tokenizer.json", directory / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    if as_file:
        (directory / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("as_file", [False, True])
def test_the_plan_uses_the_tokenizers_own_template(tmp_path, as_file):
    directory = tokenizer_dir(tmp_path, TEMPLATE, as_file)
    assert load_chat_template(directory) == TEMPLATE
    default_plan, default_shards = build_plan(config_from_dict(tiny_tree(tmp_path), config_dir=tmp_path))
    plan, shards = build_plan(
        config_from_dict(tiny_tree(tmp_path, tokenizer={"path": str(directory)}), config_dir=tmp_path)
    )
    assert plan.digest != default_plan.digest and plan.stage_digests["render"] != default_plan.stage_digests["render"]
    tokenizer = load_tokenizer(directory)
    first = shards[0]["input_ids"][0, 0]
    text = tokenizer.decode(first[shards[0]["attention_mask"][0, 0]].tolist(), skip_special_tokens=False)
    assert "### User: " in text and "<|im_start|>" not in text
    targets = tokenizer.decode(first[shards[0]["loss_mask"][0, 0]].tolist(), skip_special_tokens=False)
    assert targets.endswith("<|im_end|>") and "###" not in targets


def test_masks_match_transformers_assistant_masks():
    """Oracle: apply_chat_template(return_assistant_tokens_mask=True) with {% generation %} markers."""
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=load_tokenizer(EXAMPLES / "tiny" / "tokenizer.json"))
    tokenizer = load_tokenizer(EXAMPLES / "tiny" / "tokenizer.json")
    conversations = read_conversations(EXAMPLES / "tiny" / "sft.jsonl")[:60]
    rendered = [render_with_template(c, GENERATION_CHATML) for c in conversations]
    for conversation, item, tokenized in zip(conversations, rendered, tokenize(tokenizer, rendered)):
        oracle = hf_tokenizer.apply_chat_template(
            conversation.template_messages(),
            chat_template=GENERATION_CHATML,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        ours = mask(tokenized, item)
        assert ours.input_ids.tolist() == oracle["input_ids"]
        assert ours.loss_mask.astype(int).tolist() == oracle["assistant_masks"]


def test_a_template_that_rewrites_earlier_turns_is_an_error(tmp_path):
    # Shows only the last assistant reply in full: adding a turn changes the rendering of the earlier ones.
    rewriting = (
        "{% for message in messages %}{% if message['role'] == 'assistant' and not loop.last %}{{ '[earlier reply]' }}"
        "{% else %}{{ message['role'] + ': ' + message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    directory = tokenizer_dir(tmp_path, rewriting)
    data = tmp_path / "data.jsonl"
    data.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "c"},
                    {"role": "assistant", "content": "d"},
                ]
            }
        )
        + "\n"
    )
    config = config_from_dict(
        tiny_tree(tmp_path, tokenizer={"path": str(directory)}, data={"path": str(data)}), config_dir=tmp_path
    )
    with pytest.raises(DataError, match=rf"^{data}:1: field messages\.1: the tokenizer's chat template renders"):
        build_plan(config)


def test_a_failing_template_names_the_record(tmp_path):
    directory = tokenizer_dir(tmp_path, "{{ raise_exception('roles must alternate') }}")
    config = config_from_dict(tiny_tree(tmp_path, tokenizer={"path": str(directory)}), config_dir=tmp_path)
    with pytest.raises(
        DataError, match=r"sft\.jsonl:1: field messages: the tokenizer's chat template failed .*roles must alternate"
    ):
        build_plan(config)
    assert not (tmp_path / "work").exists()
