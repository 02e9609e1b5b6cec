"""Records in the messages format (SFT conversations and RL trajectories) validated into typed models.

One JSON object per line of a JSONL file (or one row of a Parquet or Arrow
file); the other formats (formats/) become this one before validation. Every
record has `messages`; an RL trajectory also
has a reward or an advantage (per trajectory or per assistant turn), the
behaviour policy's logprobs on every message that carries loss, and the policy
version that sampled it. The README's "Data" section shows one of each kind.

Every problem is reported as `FILE:LINE: field F: what is wrong; what to do`
(`FILE:row N` for Parquet and Arrow), so a user can fix the data before any
training starts. Reading the files is records.py's.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import BadInputError

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
Logprob = Annotated[float, Field(allow_inf_nan=False, le=0.0)]
# Ids and versions become int64 tensors: a larger integer would overflow there, far from its line.
Int64 = Annotated[int, Field(ge=0, le=2**63 - 1)]
# A JSON escape of a UTF-16 surrogate; only then can a string hold a lone one (see lone_surrogate).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class DataError(BadInputError):
    """Bad training data: the message names the file, the line and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ToolFunction(_Strict):
    name: str = Field(min_length=1)
    """The function the assistant calls."""
    arguments: dict[str, Any] | str
    """Its arguments: a JSON object, or a string rendered verbatim (OpenAI's wire format)."""


class ToolCall(_Strict):
    id: str | None = None
    """The call id a `tool` message answers (`tool_call_id`); optional."""
    type: Literal["function"] = "function"
    function: ToolFunction


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    """Who speaks; by default the loss is taken on assistant messages only."""
    content: str | None
    """The message text; `null` only for an assistant message that makes tool calls."""
    tool_calls: list[ToolCall] | None = None
    """Assistant only: the calls this turn makes (rendered after the content)."""
    tool_call_id: str | None = None
    """Tool only: the id of the call this message answers."""
    name: str | None = None
    """Tool only: the name of the function that produced this result."""
    train: bool | None = None
    """Whether this message carries loss; default: assistant messages do, others do not."""
    logprobs: list[Logprob] | None = None
    """RL: the behaviour policy's logprob of each loss token of this message, in order."""
    token_ids: list[Int64] | None = None
    """RL, optional: the token ids the behaviour policy sampled; checked against tokenization."""
    reward: FiniteFloat | None = None
    """RL, per-turn: this assistant turn's reward (group-normalised into its advantage)."""
    advantage: FiniteFloat | None = None
    """RL, per-turn: this assistant turn's advantage, used as given."""

    @model_validator(mode="after")
    def _role_fields(self) -> "Message":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: null is allowed only for an assistant message with tool_calls; give a string")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(
                f"tool_calls: only assistant messages make tool calls, not {self.role!r}; "
                "move them to the assistant message that makes them"
            )
        if (self.tool_call_id is not None or self.name is not None) and self.role != "tool":
            raise ValueError(
                f"tool_call_id/name: only tool messages answer tool calls, not {self.role!r}; "
                "remove them or set role to 'tool'"
            )
        if (self.reward is not None or self.advantage is not None) and self.role != "assistant":
            raise ValueError(
                f"reward/advantage: per-turn values belong on assistant messages, not {self.role!r}; "
                "move them to the assistant turn they score"
            )
        if self.token_ids is not None and self.logprobs is not None and len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"token_ids: {len(self.token_ids)} ids but {len(self.logprobs)} logprobs; give one of each per sampled token"
            )
        return self

    @property
    def carries_loss(self) -> bool:
        return self.train if self.train is not None else self.role == "assistant"


class Conversation(_Strict):
    messages: list[Message] = Field(min_length=1)
    """The turns, in order; at least one must carry loss."""
    id: str | None = None
    """An optional name for the record, echoed nowhere but useful to its author."""
    metadata: dict[str, Any] | None = None
    """Free-form and ignored by training."""
    reward: FiniteFloat | None = None
    """RL: the trajectory's reward; with `group_id` and no advantage it is group-normalised."""
    advantage: FiniteFloat | None = None
    """RL: the trajectory's advantage, applied to every loss token."""
    group_id: str | int | None = None
    """RL: trajectories sampled for the same prompt share a group (group-relative advantages)."""
    policy_version: Int64 | None = None
    """RL: the version of the policy that sampled this trajectory."""

    @property
    def is_trajectory(self) -> bool:
        """An RL record: it has a reward or an advantage, for the trajectory or a turn."""
        return (
            self.reward is not None
            or self.advantage is not None
            or any(m.reward is not None or m.advantage is not None for m in self.messages)
        )

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as chat templates see them (training-only fields left out)."""
        keep = ("role", "content", "tool_calls", "tool_call_id", "name")
        return [
            {k: v for k, v in m.model_dump(include=set(keep), exclude_none=True).items()} | {"content": m.content or ""}
            for m in self.messages
        ]


@dataclass(frozen=True)
class Record:
    """A validated conversation and where it came from (`FILE:LINE` or `FILE:row N`), for error messages."""

    where: str
    conversation: Conversation
    position: int = 0
    """The record's line in its JSONL file (from 1), or its row in a Parquet or Arrow file (from 0)."""
    file_index: int = 0
    """Which of `data.path`'s files it came from."""


def _known_fields() -> list[str]:
    return sorted({name for model in (Conversation, Message, ToolCall, ToolFunction) for name in model.model_fields})


def describe_errors(error: ValidationError, known_fields: Iterable[str] | None = None) -> str:
    """Each of pydantic's errors as `field F: what is wrong (got V); what to do`.

    An unknown field is matched against `known_fields` (default: the messages
    format's) to suggest a spelling.
    """
    known = sorted(known_fields) if known_fields is not None else _known_fields()
    parts = []
    for item in error.errors():
        field = ".".join(str(p) for p in item["loc"]) or "(record)"
        kind = item["type"]
        message = item["msg"].removeprefix("Value error, ")
        got = f" (got {item['input']!r})" if "input" in item and not isinstance(item["input"], (dict, list)) else ""
        if kind == "extra_forbidden":
            close = difflib.get_close_matches(str(item["loc"][-1]), known, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            message = f"unknown field; remove it or fix its spelling{hint}, see the README's Data section"
        elif kind == "missing":
            message = f"{message}; add it (the README's Data section shows each field)"
        elif kind == "literal_error":
            message = f"{message}{got}; use one of those"
        elif kind == "finite_number":
            message = f"{message}{got}; rewards, advantages and logprobs must be finite"
        elif kind in _BOUND_FIXES:
            message = f"{message}{got}; {_bound_fix(field)}"
        elif kind == "too_short":
            message = f"{message}; give at least one message"
        elif kind != "value_error":  # our own validators already say what to do
            message = f"{message}{got}; fix the value (the README's Data section shows each field's type)"
        parts.append(f"field {field}: {message}")
    return "; ".join(parts)


_BOUND_FIXES = ("greater_than_equal", "less_than_equal")


def _bound_fix(field: str) -> str:
    if ".logprobs." in f".{field}.":
        return "a logprob is the log of a probability, so it is at most 0"
    if ".token_ids." in f".{field}.":
        return "token ids index the tokenizer's vocabulary"
    if field == "policy_version":
        return "give the (non-negative) version of the policy that sampled the trajectory"
    return "fix the value"


def lone_surrogate(value: Any, field: str = "") -> str | None:
    """The field of the first string holding a lone UTF-16 surrogate (not a character), if any."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return field or "(record)"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        path = f"{field}.{key}" if field else str(key)
        found = lone_surrogate(key, path) if isinstance(key, str) else None
        found = found or lone_surrogate(child, path)
        if found:
            return found
    return None


def _check_trajectory(conversation: Conversation, where: str) -> None:
    """RL-only rules that span several fields of one record."""
    per_turn = any(m.reward is not None or m.advantage is not None for m in conversation.messages)
    if per_turn and (conversation.reward is not None or conversation.advantage is not None):
        raise DataError(
            f"{where}: field reward: give rewards/advantages either per trajectory or per assistant turn, not both"
        )
    if conversation.policy_version is None:
        raise DataError(
            f"{where}: field policy_version: required for an RL trajectory; give the version of the policy that sampled it"
        )
    for index, message in enumerate(conversation.messages):
        if message.carries_loss and message.logprobs is None:
            raise DataError(
                f"{where}: field messages.{index}.logprobs: required on every message that carries loss in an RL "
                "trajectory (one behaviour logprob per loss token); add them or set train=false"
            )
        if message.logprobs is not None and not message.carries_loss:
            raise DataError(
                f"{where}: field messages.{index}.logprobs: this message carries no loss, so its logprobs would be ignored; remove them or set train=true"
            )
    if per_turn:
        for index, message in enumerate(conversation.messages):
            if (
                message.role == "assistant"
                and message.carries_loss
                and message.reward is None
                and message.advantage is None
            ):
                raise DataError(
                    f"{where}: field messages.{index}.reward: with per-turn rewards every assistant turn that carries loss needs a reward or an advantage"
                )


def decode_line(raw: bytes | str, where: str) -> Any:
    """One JSONL line as the JSON value it holds (a pure function; `where` is `FILE:LINE` for messages)."""
    try:
        record = json.loads(raw)
    except UnicodeDecodeError as error:
        raise DataError(
            f"{where}: not UTF-8 text (byte 0x{error.object[error.start]:02x} at column {error.start + 1}); "
            "save the file as UTF-8"
        ) from None
    except json.JSONDecodeError as error:
        raise DataError(
            f"{where}: not valid JSON ({error.msg} at column {error.pos + 1}); each line must be one JSON object"
        ) from None
    except RecursionError:
        raise DataError(
            f"{where}: not valid JSON (nested too deeply to read); each line must be one JSON object "
            "of messages, nested a few levels deep"
        ) from None
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if _SURROGATE_ESCAPE.search(raw):
        field = lone_surrogate(record)
        if field is not None:
            raise DataError(
                f"{where}: field {field}: holds a lone UTF-16 surrogate escape (such as \\ud800), which "
                "is not a character; fix the escape (a pair like \\ud83d\\ude00 is one character) or remove it"
            )
    return record


def validate_record(record: Any, where: str) -> Conversation:
    """A decoded record (a JSONL line's object, a row, or another format's record converted) as a Conversation."""
    if not isinstance(record, dict):
        raise DataError(
            f"{where}: expected a JSON object with a 'messages' list, got {type(record).__name__}; "
            'write each line as {"messages": [{"role": …, "content": …}, …]}'
        )
    try:
        conversation = Conversation.model_validate(record)
    except ValidationError as error:
        raise DataError(f"{where}: {describe_errors(error)}") from None
    if not any(m.carries_loss for m in conversation.messages):
        if not any(m.role == "assistant" for m in conversation.messages):
            raise DataError(
                f"{where}: field messages: no assistant message, so nothing would carry loss; add one or remove the line"
            )
        raise DataError(
            f"{where}: field messages: every message has train=false, so nothing would carry loss; train on one or remove the line"
        )
    if conversation.is_trajectory:
        _check_trajectory(conversation, where)
    else:
        stray = [name for name in ("group_id", "policy_version") if getattr(conversation, name) is not None]
        stray += [f"messages.{i}.logprobs" for i, m in enumerate(conversation.messages) if m.logprobs is not None]
        if stray:
            raise DataError(
                f"{where}: field {stray[0]}: RL fields without a reward or an advantage; add `reward` (with `group_id`) or `advantage`"
            )
    return conversation


def parse_record(raw: bytes | str, where: str) -> Conversation:
    """Validate one JSONL line in the messages format (a pure function; `where` is `FILE:LINE` for messages)."""
    return validate_record(decode_line(raw, where), where)
