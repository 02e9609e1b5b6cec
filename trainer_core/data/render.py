"""Stage 1, render: a conversation to text, with the character spans that carry loss.

Two renderers give the same `Rendered` value:

- the default, ChatML: `<|im_start|>ROLE\\nBODY<|im_end|>\\n` per message. The
  BODY is the content, then each tool call of an assistant message as
  `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>` (joined to
  the content and to each other by `\\n`; ARGS is the JSON object, or the
  string given). A `tool` message's BODY is its content. A message that carries
  loss has its BODY and closing `<|im_end|>` in the loss span, so the model
  learns to stop; role headers are context only. `CHATML_TEMPLATE` is the same
  rendering as a Jinja chat template (exported with the tokenizer).
- a tokenizer's own Jinja chat template. Its loss spans come from rendering
  prefixes: message i's span is what `messages[:i+1]` adds to `messages[:i]`
  rendered with the generation prompt (assistant turns) or, for other roles,
  from where its content starts; trailing whitespace is left out. A template
  that rewrites earlier turns when a later one is added (so a prefix is not a
  prefix) cannot say which tokens a turn produced, and is an error.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..input_files import read_input_json_object, read_input_text
from .schema import Conversation, DataError, Message

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
_MARKER = "\ue000rankflow-content\ue000"  # private-use characters: never in real content

# The same rendering as `render_chatml`, written into exported tokenizers so
# that inference formats prompts exactly as training did (a test pins them equal).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{% if message.tool_calls %}{% for tc in message.tool_calls %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": ' + (tc.function.name | tojson) + ', \"arguments\": ' }}"
    "{% if tc.function.arguments is string %}{{ tc.function.arguments }}{% else %}{{ tc.function.arguments | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Rendered:
    text: str
    loss_spans: tuple[tuple[int, int], ...]
    """Half-open character ranges of `text` whose tokens carry loss, in order."""
    span_messages: tuple[int, ...]
    """The message index of each loss span."""

    def update_digest(self, hasher: "hashlib._Hash") -> None:
        encoded = self.text.encode()
        hasher.update(f"{len(encoded)};{self.loss_spans};{self.span_messages};".encode())
        hasher.update(encoded)

    def digest(self) -> str:
        hasher = hashlib.sha256()
        self.update_digest(hasher)
        return hasher.hexdigest()


def _tool_call_text(message: Message) -> list[str]:
    calls = []
    for call in message.tool_calls or ():
        arguments = call.function.arguments
        arguments_text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        calls.append(
            f'<tool_call>\n{{"name": {json.dumps(call.function.name, ensure_ascii=False)}, "arguments": {arguments_text}}}\n</tool_call>'
        )
    return calls


def render_chatml(conversation: Conversation) -> Rendered:
    """The default template (see the module docstring)."""
    pieces: list[str] = []
    spans: list[tuple[int, int]] = []
    span_messages: list[int] = []
    offset = 0
    for index, message in enumerate(conversation.messages):
        header = f"{IM_START}{message.role}\n"
        content = message.content or ""
        body = "\n".join(([content] if content else []) + _tool_call_text(message)) + IM_END
        if message.carries_loss:
            spans.append((offset + len(header), offset + len(header) + len(body)))
            span_messages.append(index)
        piece = header + body + "\n"
        pieces.append(piece)
        offset += len(piece)
    return Rendered(text="".join(pieces), loss_spans=tuple(spans), span_messages=tuple(span_messages))


def _render_jinja(template: str, messages: list[dict], add_generation_prompt: bool) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[messages], chat_template=template, add_generation_prompt=add_generation_prompt
    )
    return rendered[0]


def render_with_template(conversation: Conversation, template: str, *, where: str = "(conversation)") -> Rendered:
    """Render with a tokenizer's Jinja chat template (see the module docstring)."""
    messages = conversation.template_messages()

    def render(count: int, add_generation_prompt: bool = False, last: dict | None = None) -> str:
        shown = messages[:count] if last is None else messages[: count - 1] + [last]
        try:
            return _render_jinja(template, shown, add_generation_prompt)
        except Exception as error:  # noqa: BLE001 - any template failure is bad input for this record
            raise DataError(
                f"{where}: field messages: the tokenizer's chat template failed on the first {count} message(s) "
                f"({type(error).__name__}: {error}); fix the record or the template"
            ) from None

    text = render(len(messages))
    spans: list[tuple[int, int]] = []
    span_messages: list[int] = []
    for index, message in enumerate(conversation.messages):
        if not message.carries_loss:
            continue
        prefix = render(index, add_generation_prompt=message.role == "assistant")
        upto = render(index + 1)
        if not (upto.startswith(prefix) and text.startswith(upto)):
            raise DataError(
                f"{where}: field messages.{index}: the tokenizer's chat template renders the conversation up to this "
                "message differently from its prefix (it rewrites earlier turns), so the tokens this message adds are "
                "not defined; use a prefix-stable template (e.g. the default ChatML) for training"
            )
        start, end = len(prefix), len(upto.rstrip())
        if message.role != "assistant":
            # Where the content starts: render the message with a marker as its content.
            marked = render(index + 1, last=messages[index] | {"content": _MARKER})
            found = marked.find(_MARKER)
            if found < start or marked[:found] != upto[:found]:
                raise DataError(
                    f"{where}: field messages.{index}.content: train=true on a {message.role} message, but the chat template does not render its content verbatim"
                )
            start = found
        if end <= start:
            raise DataError(
                f"{where}: field messages.{index}: the chat template renders this message as nothing, so it cannot carry loss; set train=false"
            )
        spans.append((start, end))
        span_messages.append(index)
    return Rendered(text=text, loss_spans=tuple(spans), span_messages=tuple(span_messages))


def render(conversation: Conversation, template: str | None = None, *, where: str = "(conversation)") -> Rendered:
    """Stage 1: the default ChatML rendering, or the tokenizer's template when it has one."""
    if template is None:
        return render_chatml(conversation)
    return render_with_template(conversation, template, where=where)


def load_chat_template(tokenizer_path: str | Path) -> str | None:
    """The Jinja chat template of a tokenizer directory, or None (a bare tokenizer.json has none).

    Looked up as transformers does: `chat_template.jinja`, then the
    `chat_template` key of `tokenizer_config.json` (a string, or a list of named
    templates, of which `default` is used).
    """
    path = Path(tokenizer_path)
    if not path.is_dir():
        return None
    label = f"tokenizer.path={str(path)!r}"
    jinja_file = path / "chat_template.jinja"
    if jinja_file.exists():
        return read_input_text(jinja_file, label, "remove chat_template.jinja to train with ChatML")
    config_file = path / "tokenizer_config.json"
    if not config_file.exists():
        return None
    tokenizer_config = read_input_json_object(
        config_file, label, "remove tokenizer_config.json to use tokenizer.json alone"
    )
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise DataError(
            f"{config_file}: field chat_template: expected a Jinja string or a list of named templates "
            f"(got {type(template).__name__}); fix it, or remove it to train with ChatML"
        )
    return template
