"""Which format a file's records are in, and the check that every record of the file is in it.

With `data.format = "auto"` a file is in the format of its first record: the
one whose marker fields (`messages`; `conversations`; `prompt`/`completion`)
the record has, or the messages format when it has none (so a record missing
its `messages` is reported as today). A set `data.format` is the format of
every file. Either way a record that carries another format's markers and not
its file's is an error naming the field that gives it away: one file holds one
format, so a record in another one is a mistake, never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..schema import DataError
from . import FORMATS, RecordFormat


def _has_any(record: dict, fields: tuple[str, ...]) -> bool:
    for field in fields:  # a loop, not any(generator): this runs once a record
        if field in record:
            return True
    return False


def detect(record: Any) -> RecordFormat | None:
    """The format whose marker fields the record has (None: it has no format's markers, or is no object)."""
    if not isinstance(record, dict):
        return None
    return next((fmt for fmt in FORMATS.values() if any(marker in record for marker in fmt.markers)), None)


@dataclass(frozen=True)
class FileFormat:
    """A file's format and why it is that one (for messages)."""

    format: RecordFormat
    reason: str
    """`data.format='sharegpt'`, or `its first record, FILE:LINE, is ShareGPT`."""
    explicit: bool
    first_where: str | None = None
    """The record the format was detected from (None: set by the config, or the file has none)."""
    option: str = "data.format"
    """What set the format: the config key, or `rankflow eval`'s --format."""

    @classmethod
    def of_first_record(cls, record: Any, where: str) -> "FileFormat":
        found = detect(record) or FORMATS["messages"]
        return cls(found, f"its first record, {where}, is {found.title}", explicit=False, first_where=where)

    @classmethod
    def set_by_config(cls, name: str, option: str = "data.format") -> "FileFormat":
        return cls(FORMATS[name], f"{option}={name!r}", explicit=True, option=option)

    @classmethod
    def default(cls) -> "FileFormat":
        """An empty file's (it has no record to be in another format)."""
        return cls(FORMATS["messages"], "the file is empty", explicit=False)

    def to_messages(self, record: Any, where: str) -> Any:
        """The record converted to the messages format; a record in another format is a DataError."""
        # A record with its file's marker (nearly all of them) needs no detection: the JSONL fast path.
        found = None
        if not (isinstance(record, dict) and _has_any(record, self.format.markers)):
            found = detect(record)
        if found is not None and found is not self.format:
            marker = next(m for m in found.markers if m in record)
            choice = (
                f"give {self.option} auto (or {found.name})"
                if self.option.startswith("--")
                else f"set {self.option}='auto' (or {found.name!r})"
            )
            fix = (
                f"{choice} to read the file as its records are, or convert it"
                if self.explicit
                else "one file holds one format: convert this record (docs/data.md shows each format) or move it "
                "to a file of its own"
            )
            raise DataError(
                f"{where}: field {marker}: a {found.title} record in a {self.format.title} file ({self.reason}); {fix}"
            )
        return self.format.to_messages(record, where)
