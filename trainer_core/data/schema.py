"""JSONL conversation records validated into typed models.

Every problem is reported with the file, the line and the field, so a user can
fix the data before any training starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class DataError(ValueError):
    """Bad training data: the message names the file, the line and the field."""


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "user", "assistant"]
    """Who speaks; the loss is taken on assistant messages."""
    content: str
    """The message text."""


class Conversation(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    messages: list[Message] = Field(min_length=1)
    """The turns, in order; at least one assistant message must carry loss."""


def _describe(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        field = ".".join(str(p) for p in item["loc"]) or "(record)"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown field"
        elif item["type"] == "literal_error":
            message = f"{message} (got {item['input']!r})"
        parts.append(f"field {field}: {message}")
    return "; ".join(parts)


def read_conversations(path: str | Path) -> list[Conversation]:
    """Parse and validate every line of a JSONL file; the first problem raises DataError."""
    path = Path(path)
    conversations: list[Conversation] = []
    with path.open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue  # blank lines (often a trailing newline) carry nothing
            where = f"{path}:{line_number}"
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise DataError(f"{where}: not valid JSON ({error}); each line must be one JSON object") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object with a 'messages' list, got {type(record).__name__}")
            try:
                conversation = Conversation.model_validate(record)
            except ValidationError as error:
                raise DataError(f"{where}: {_describe(error)}") from None
            if not any(m.role == "assistant" for m in conversation.messages):
                raise DataError(f"{where}: field messages: no assistant message, so nothing would carry loss; add one or remove the line")
            conversations.append(conversation)
    if not conversations:
        raise DataError(f"{path}: no conversations found; the file is empty")
    return conversations
