"""ShareGPT records: `{"conversations": [{"from": …, "value": …}, …]}`, turned into the messages format.

The roles as FastChat's and LLaMA-Factory's ShareGPT data use them:

    from                 becomes
    human, user          a user message
    gpt, assistant       an assistant message (carries loss)
    system               a system message (or a top-level "system" string, put first)
    function_call        an assistant message whose tool_calls are the value's JSON
                         {"name": …, "arguments": …} (or a list of them); it carries loss
    observation, tool    a tool message (a tool's result)

Anything else is refused with the accepted names: other roles (`bing`,
`chatgpt` of raw ShareGPT dumps) have no standard meaning, a top-level `tools`
list has no place in the messages format either (put the tool descriptions in
the system prompt), and RL fields belong to the messages format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..schema import DataError, ToolFunction, describe_errors, lone_surrogate
from .base import FormatName, message_field_parts, refuse_rl_fields, require_object

_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}
_EXAMPLE = 'write it as {"conversations": [{"from": "human", "value": …}, {"from": "gpt", "value": …}]}'


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=False)


class _Turn(_Strict):
    speaker: Literal["human", "user", "gpt", "assistant", "system", "function_call", "observation", "tool"] = Field(
        alias="from"
    )
    value: str


class _ShareGPT(_Strict):
    conversations: list[_Turn] = Field(min_length=1)
    system: str | None = None
    id: str | None = None
    metadata: dict[str, Any] | None = None


_KNOWN = ["conversations", "from", "value", "system", "id", "metadata"]


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _tool_calls(value: str, where: str) -> list[dict[str, Any]]:
    """A function_call turn's value, `{"name", "arguments"}` or a list of them, as OpenAI tool calls."""
    fix = 'give JSON {"name": NAME, "arguments": {…}} (or a list of them), as LLaMA-Factory writes it'
    try:
        calls = json.loads(value, parse_constant=_refuse_constant)  # NaN and Infinity are not JSON
    except (json.JSONDecodeError, RecursionError, ValueError):
        raise DataError(f"{where}: not valid JSON; a function_call turn's value is the call: {fix}") from None
    # The line's own check saw the escape only as text inside a string: decoded here, it may be a lone surrogate.
    inner = lone_surrogate(calls)
    if inner is not None:
        raise DataError(
            f"{where}: the call's {inner} holds a lone UTF-16 surrogate escape (such as \\ud800), which is not a "
            "character; fix the escape (a pair like \\ud83d\\ude00 is one character) or remove it"
        )
    calls = calls if isinstance(calls, list) else [calls]
    converted = []
    for call in calls:
        try:
            function = ToolFunction.model_validate(call)
        except ValidationError as error:
            raise DataError(f"{where}: not a call ({describe_errors(error, ['name', 'arguments'])}); {fix}") from None
        converted.append({"type": "function", "function": function.model_dump()})
    if not converted:
        raise DataError(f"{where}: an empty list of calls; {fix}")
    return converted


@dataclass(frozen=True)
class _ShareGPTFormat:
    name: FormatName = "sharegpt"
    title: str = "ShareGPT"
    markers: tuple[str, ...] = ("conversations",)

    def to_messages(self, record: Any, where: str) -> dict[str, Any]:
        record = require_object(record, where, self.title, _EXAMPLE)
        refuse_rl_fields(record, where, self.title)
        if "tools" in record:
            raise DataError(
                f"{where}: field tools: tool descriptions are not rendered (the messages format has no place for them "
                "either); describe the tools in the system prompt, or remove the field"
            )
        try:
            parsed = _ShareGPT.model_validate(record)
        except ValidationError as error:
            raise DataError(f"{where}: {describe_errors(error, _KNOWN)}") from None
        if not any(_ROLES[turn.speaker] == "assistant" for turn in parsed.conversations):
            raise DataError(
                f"{where}: field conversations: no turn from 'gpt' (or 'assistant', 'function_call'), so nothing would "
                "carry loss; add one or remove the record"
            )
        messages: list[dict[str, Any]] = []
        if parsed.system is not None:
            messages.append({"role": "system", "content": parsed.system})
        for index, turn in enumerate(parsed.conversations):
            if turn.speaker == "function_call":
                calls = _tool_calls(turn.value, f"{where}: field conversations.{index}.value")
                messages.append({"role": "assistant", "content": None, "tool_calls": calls})
            else:
                messages.append({"role": _ROLES[turn.speaker], "content": turn.value})
        converted: dict[str, Any] = {"messages": messages}
        if parsed.id is not None:
            converted["id"] = parsed.id
        if parsed.metadata is not None:
            converted["metadata"] = parsed.metadata
        return converted

    def field_as_written(self, field: str, record: Any) -> str:
        """`messages` is `conversations`; message I is turn I (I - 1 after a top-level `system`, which is message
        0), its content, role and tool calls the turn's `value`, `from` and `value`."""
        parts = message_field_parts(field)
        if parts is None:
            return field
        index, name = parts
        if index is None:
            return "conversations"
        index -= 1 if isinstance(record, dict) and record.get("system") is not None else 0
        if index < 0:
            return "system"
        name = _TURN_FIELDS.get(name, name) if name is not None else None
        return f"conversations.{index}" + (f".{name}" if name else "")


_TURN_FIELDS = {"content": "value", "role": "from", "tool_calls": "value"}

SHAREGPT = _ShareGPTFormat()
