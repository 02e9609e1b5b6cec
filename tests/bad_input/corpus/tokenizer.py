"""Bad-input cases: the tokenizer."""

from __future__ import annotations

import json

from .common import TOKENIZER_JSON, Case, directory, fifo, tokenizer_case

CASES: list[Case] = [
    Case(
        "tokenizer_missing",
        "tokenizer",
        r"tokenizer\.path='{dir}/tok\.json' does not exist",
        r"point it at tokenizer\.json",
        config={"tokenizer": {"path": "{dir}/tok.json"}},
    ),
    tokenizer_case(
        "tokenizer_dir_without_json",
        {"tok": directory},
        r"tokenizer\.path='{dir}/tok': the directory has no tokenizer\.json",
        r"point tokenizer\.path at a complete tokenizer\.json",
    ),
    tokenizer_case(
        "tokenizer_empty",
        {"tok/tokenizer.json": ""},
        r"{dir}/tok/tokenizer\.json is empty",
        r"point tokenizer\.path at",
    ),
    tokenizer_case(
        "tokenizer_corrupt_json",
        {"tok/tokenizer.json": '{"version": "1.0",\n  "model": {'},
        r"{dir}/tok/tokenizer\.json:2:13: not valid JSON",
        r"fix the file",
    ),
    tokenizer_case(
        "tokenizer_not_utf8",
        {"tok/tokenizer.json": b'{"version": "\xfe"}'},
        r"{dir}/tok/tokenizer\.json:1:14: not UTF-8 text",
        r"save it as UTF-8",
    ),
    tokenizer_case(
        "tokenizer_incomplete",
        {"tok/tokenizer.json": '{"version": "1.0"}'},
        r"{dir}/tok/tokenizer\.json is not a usable tokenizer \(Model missing",
        r"point tokenizer\.path at a complete",
    ),
    tokenizer_case(
        "tokenizer_truncated",
        {"tok/tokenizer.json": TOKENIZER_JSON[: len(TOKENIZER_JSON) // 2]},
        r"{dir}/tok/tokenizer\.json:\d+:\d+: not valid JSON",
        r"fix the file",
    ),
    tokenizer_case(
        "tokenizer_empty_vocabulary",
        {
            "tok/tokenizer.json": json.dumps(
                {"version": "1.0", "model": {"type": "WordLevel", "vocab": {}, "unk_token": "[UNK]"}}
            )
        },
        r"{dir}/tok/tokenizer\.json has an empty vocabulary",
        r"point tokenizer\.path at a complete",
    ),
    tokenizer_case(
        "tokenizer_is_fifo",
        {"tok.json": fifo},
        r"tokenizer\.path='{dir}/tok\.json': is a FIFO",
        r"point tokenizer\.path at",
        path="{dir}/tok.json",
    ),
    tokenizer_case(
        "tokenizer_config_corrupt",
        {"tok/tokenizer.json": TOKENIZER_JSON, "tok/tokenizer_config.json": "{bad"},
        r"{dir}/tok/tokenizer_config\.json:1:2: not valid JSON",
        r"remove tokenizer_config\.json to use tokenizer\.json alone",
    ),
    tokenizer_case(
        "chat_template_syntax_error",
        {
            "tok/tokenizer.json": TOKENIZER_JSON,
            "tok/chat_template.jinja": "{% for message in messages %}{{ message.content }",
        },
        r"tokenizer\.path='{dir}/tok': the chat template does not compile",
        r"fix its Jinja syntax",
    ),
    tokenizer_case(
        "chat_template_not_a_string",
        {"tok/tokenizer.json": TOKENIZER_JSON, "tok/tokenizer_config.json": '{"chat_template": 5}'},
        r"{dir}/tok/tokenizer_config\.json: field chat_template: expected a Jinja string",
        r"remove it to train with ChatML",
    ),
    tokenizer_case(
        "chat_template_not_utf8",
        {"tok/tokenizer.json": TOKENIZER_JSON, "tok/chat_template.jinja": b"{{ '\xff' }}"},
        r"{dir}/tok/chat_template\.jinja:1:5: not UTF-8 text",
        r"save it as UTF-8",
    ),
    tokenizer_case(
        "chat_template_fails_on_a_record",
        {
            "tok/tokenizer.json": TOKENIZER_JSON,
            "tok/chat_template.jinja": "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}"
            "{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
        },
        r"{tiny}/sft\.jsonl:\d+: field messages: the tokenizer's chat template failed",
        r"fix the record or the template",
    ),
]
