"""Render a conversation to text and mark the character spans that carry loss.

The default template is ChatML (`<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`). The
loss covers each assistant message's content and its closing `<|im_end|>`, so
the model learns to stop; role headers and other turns are context only.
"""

from __future__ import annotations

from dataclasses import dataclass

from .schema import Conversation

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# The same rendering as a Jinja chat template, written into exported tokenizers
# so that inference formats prompts exactly as training did.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Rendered:
    text: str
    loss_spans: tuple[tuple[int, int], ...]
    """Half-open character ranges of `text` whose tokens carry loss."""


def render_chatml(conversation: Conversation) -> Rendered:
    pieces: list[str] = []
    spans: list[tuple[int, int]] = []
    offset = 0
    for message in conversation.messages:
        header = f"{IM_START}{message.role}\n"
        body = f"{message.content}{IM_END}"
        if message.role == "assistant":
            spans.append((offset + len(header), offset + len(header) + len(body)))
        piece = header + body + "\n"
        pieces.append(piece)
        offset += len(piece)
    return Rendered(text="".join(pieces), loss_spans=tuple(spans))
