"""Bad-input cases: the model: model.config."""

from __future__ import annotations

import json

from .common import MODEL_CONFIG, Case, directory, fifo, model_config, model_config_case

CASES: list[Case] = [
    Case(
        "model_config_missing",
        "model",
        r"model\.config='{dir}/nope\.json' does not exist",
        r"point it at a config\.json",
        config={"model": {"config": "{dir}/nope.json"}},
    ),
    model_config_case(
        "model_config_is_directory",
        directory,
        r"model\.config='{dir}/model_config\.json': is a directory",
        r"point model\.config at a Hugging Face config\.json",
    ),
    model_config_case(
        "model_config_is_fifo",
        fifo,
        r"model\.config='{dir}/model_config\.json': is a FIFO",
        r"point model\.config at a Hugging Face config\.json",
    ),
    model_config_case(
        "model_config_empty",
        "",
        r"model\.config='{dir}/model_config\.json': {dir}/model_config\.json is empty",
        r"point model\.config at",
    ),
    model_config_case(
        "model_config_corrupt",
        '{"model_type": "qwen3",\n "vocab_size": 1024,,\n}',
        r"{dir}/model_config\.json:2:21: not valid JSON",
        r"fix the file or point model\.config at",
    ),
    model_config_case(
        "model_config_truncated",
        model_config()[:200],
        r"{dir}/model_config\.json:\d+:\d+: not valid JSON",
        r"fix the file",
    ),
    model_config_case(
        "model_config_not_utf8",
        b'{"model_type": "qwen3", "name": "\xff"}',
        r"{dir}/model_config\.json:1:34: not UTF-8 text \(byte 0xff\)",
        r"save it as UTF-8",
    ),
    model_config_case(
        "model_config_not_an_object",
        "[1, 2]",
        r"{dir}/model_config\.json holds a JSON list, not an object",
        r"point model\.config at",
    ),
    model_config_case(
        "model_config_without_model_type",
        json.dumps({k: v for k, v in MODEL_CONFIG.items() if k != "model_type"}),
        r"{dir}/model_config\.json: has no 'model_type'",
        r"add one such as \"qwen3\"",
    ),
    model_config_case(
        "model_config_unknown_model_type",
        model_config(model_type="gpt-banana"),
        r"{dir}/model_config\.json: model_type='gpt-banana' is not a model type",
        r"use one such as \"qwen3\"",
    ),
    model_config_case(
        "model_hidden_size_zero",
        model_config(hidden_size=0),
        r"{dir}/model_config\.json: hidden_size=0 must be a positive whole number",
        r"set it to the model's real hidden_size",
    ),
    model_config_case(
        "model_layers_negative",
        model_config(num_hidden_layers=-1),
        r"{dir}/model_config\.json: num_hidden_layers=-1 must be a positive whole number",
        r"set it to",
    ),
    model_config_case(
        "model_vocab_zero",
        model_config(vocab_size=0),
        r"{dir}/model_config\.json: vocab_size=0 must be a positive whole number",
        r"set it to",
    ),
    model_config_case(
        "model_size_not_a_number",
        model_config(intermediate_size="big"),
        r"{dir}/model_config\.json: intermediate_size='big' must be a positive whole number",
        r"set it to",
    ),
    model_config_case(
        "model_vocab_smaller_than_tokenizer",
        model_config(vocab_size=100),
        r"{dir}/model_config\.json: vocab_size=100 is smaller than the tokenizer's 1024 tokens",
        r"use a model whose vocab_size is at least 1024",
    ),
    model_config_case(
        "model_heads_do_not_divide",
        model_config(num_key_value_heads=3),
        r"{dir}/model_config\.json: does not describe a working model",
        r"fix its sizes",
    ),
    model_config_case(
        "model_layer_types_mismatch",
        model_config(layer_types=["full_attention"]),
        r"{dir}/model_config\.json: not a valid qwen3 config",
        r"fix it, or point model\.config at",
    ),
    model_config_case(
        "model_positions_too_few",
        model_config(max_position_embeddings=16),
        r"{tiny}/sft\.jsonl:\d+: field messages: \d+ tokens need \d+ positions, more than the model's max_position_embeddings=16",
        r"set data\.max_seq_len to at most 16",
    ),
]
