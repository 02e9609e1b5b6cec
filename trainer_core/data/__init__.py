"""Training data: schema, rendering and tokenization of conversations."""

from .render import CHATML_TEMPLATE, Rendered, render_chatml
from .schema import Conversation, DataError, Message, read_conversations
from .tokenize import TokenizedSequence, load_tokenizer, tokenize_rendered

__all__ = [
    "CHATML_TEMPLATE",
    "Conversation",
    "DataError",
    "Message",
    "Rendered",
    "TokenizedSequence",
    "load_tokenizer",
    "read_conversations",
    "render_chatml",
    "tokenize_rendered",
]
