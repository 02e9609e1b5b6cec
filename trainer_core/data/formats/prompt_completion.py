"""Prompt/completion pairs: `{"prompt": "…", "completion": "…"}` (and an optional `system`), as one chat turn.

A pair becomes `[system?, user: prompt, assistant: completion]`, so it is
rendered by the same chat template as every conversation (TRL's conversational
prompt-completion form) and the loss covers the completion alone: the
assistant message's body and its closing end-of-turn token, never the prompt.
Both are strings; a prompt or completion that is a list of messages is the
messages format, written as `{"messages": prompt + completion}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from ..schema import DataError, describe_errors
from .base import FormatName, message_field_parts, refuse_rl_fields, require_object

_EXAMPLE = 'write it as {"prompt": "…", "completion": "…"}'


class _PromptCompletion(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt: str
    completion: str
    system: str | None = None
    id: str | None = None
    metadata: dict[str, Any] | None = None


@dataclass(frozen=True)
class _PromptCompletionFormat:
    name: FormatName = "prompt_completion"
    title: str = "prompt/completion"
    markers: tuple[str, ...] = ("prompt", "completion")

    def to_messages(self, record: Any, where: str) -> dict[str, Any]:
        record = require_object(record, where, self.title, _EXAMPLE)
        refuse_rl_fields(record, where, self.title)
        for field in ("prompt", "completion"):
            if isinstance(record.get(field), list):
                raise DataError(
                    f"{where}: field {field}: a list of messages; prompt and completion are strings here, and a "
                    'conversation is the messages format: write {"messages": prompt + completion} instead'
                )
        try:
            pair = _PromptCompletion.model_validate(record)
        except ValidationError as error:
            raise DataError(f"{where}: {describe_errors(error, _PromptCompletion.model_fields)}") from None
        messages = [{"role": "system", "content": pair.system}] if pair.system is not None else []
        messages += [{"role": "user", "content": pair.prompt}, {"role": "assistant", "content": pair.completion}]
        converted: dict[str, Any] = {"messages": messages}
        if pair.id is not None:
            converted["id"] = pair.id
        if pair.metadata is not None:
            converted["metadata"] = pair.metadata
        return converted

    def field_as_written(self, field: str, record: Any) -> str:
        """`messages` is the pair (`prompt/completion`); its messages are `system`, `prompt` and `completion`."""
        parts = message_field_parts(field)
        if parts is None:
            return field
        index, _ = parts  # a message's content is the field itself
        if index is None:
            return "prompt/completion"
        names = ["prompt", "completion"]
        if isinstance(record, dict) and record.get("system") is not None:
            names.insert(0, "system")
        return names[index] if index < len(names) else field


PROMPT_COMPLETION = _PromptCompletionFormat()
