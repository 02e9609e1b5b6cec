"""The messages format (OpenAI's chat format): already what every later stage reads; schema.py validates it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import FormatName


@dataclass(frozen=True)
class _Messages:
    name: FormatName = "messages"
    title: str = "messages"
    markers: tuple[str, ...] = ("messages",)

    def to_messages(self, record: Any, where: str) -> Any:
        return record  # schema.validate_record checks it, with today's messages

    def field_as_written(self, field: str, record: Any) -> str:
        return field


MESSAGES = _Messages()
