"""What a record format is (`RecordFormat`), and the refusals every non-messages format shares."""

from __future__ import annotations

from typing import Any, Literal, Protocol

from ..schema import DataError

FormatName = Literal["messages", "sharegpt", "prompt_completion"]
RL_FIELDS = ("reward", "advantage", "group_id", "policy_version")


class RecordFormat(Protocol):
    """One format of data records: how to recognise it and how to turn a record into the messages format."""

    @property
    def name(self) -> FormatName:
        """The format's `data.format` value."""
        ...

    @property
    def title(self) -> str:
        """The format's name in messages ("ShareGPT")."""
        ...

    @property
    def markers(self) -> tuple[str, ...]:
        """Top-level fields that only this format's records have: detection looks for them."""
        ...

    def to_messages(self, record: Any, where: str) -> Any:
        """The record in the messages format (validated by schema.validate_record next), or DataError naming
        `where` (FILE:LINE or FILE:row N), the field in this format's terms and the fix."""
        ...

    def field_as_written(self, field: str, record: Any) -> str:
        """A field of the converted record (`messages`, `messages.I`, `messages.I.content`) as `record`, this
        format's own, spells it: the name a later stage's error gives the user."""
        ...


def refuse_rl_fields(record: dict, where: str, title: str) -> None:
    """RL trajectories need per-message logprobs, which only the messages format has a place for."""
    found = next((name for name in RL_FIELDS if name in record), None)
    if found is not None:
        raise DataError(
            f"{where}: field {found}: RL trajectories are read in the messages format only ({title} records "
            'have no place for per-message logprobs); write this record as {"messages": [...], ...}, '
            "see docs/data.md"
        )


def require_object(record: Any, where: str, title: str, example: str) -> dict:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object (a {title} record), got {type(record).__name__}; {example}")
    return record


def message_field_parts(field: str) -> tuple[int | None, str | None] | None:
    """`messages.I.NAME` as (I, NAME), `messages` as (None, None); None for a field outside the messages list."""
    parts = field.split(".")
    if parts[0] != "messages" or len(parts) > 3 or (len(parts) > 1 and not parts[1].isdigit()):
        return None
    return (int(parts[1]) if len(parts) > 1 else None), (parts[2] if len(parts) > 2 else None)
