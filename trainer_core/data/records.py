"""The validated records of `data.path`: its files in order, each file's rows in its format, as messages.

    data.path → files (trainer_core/data_sources.py) → rows (readers/) → messages records (formats/) → Conversations (schema.py)

The data holds one kind of record, SFT conversations or RL trajectories, and
one format: with `data.format = "auto"` each file's format is its first
record's, and files of different formats are an error (a mix is more likely a
wrong file than a plan). Only the first record is kept (to check the others
against it), so data of any size streams through in constant memory.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..data_sources import DataFile, DataPath, data_files
from .formats.detection import FileFormat
from .readers import rows
from .schema import Conversation, DataError, Record, validate_record


@dataclass(frozen=True)
class DataSource:
    """The files of `data.path` and the format each one's records are read in (one format for all)."""

    files: tuple[DataFile, ...]
    formats: tuple[FileFormat, ...]

    @property
    def format_name(self) -> str:
        """The data's format ("messages" when every file is empty: they fail when read)."""
        return next((f.format.name for f in self.formats if f.first_where or f.explicit), "messages")

    @property
    def label(self) -> str:
        """The data as a message names it as a whole: its file, or its first file and how many more."""
        first = str(self.files[0].path)
        return (
            first if len(self.files) == 1 else f"{first} (and {len(self.files) - 1} more files of {self.files[0].key})"
        )

    def where(self, file_index: int, position: int) -> str:
        return self.files[file_index].where(position)

    @contextlib.contextmanager
    def fields_as_written(self) -> Iterator[None]:
        """Data errors raised inside name a record's field as its file spells it.

        Every stage after the conversion (rendering, lengths, positions) sees the messages format, and its errors
        say `field messages…`; a ShareGPT file says `conversations`. The record's own format respells the field,
        reading the record again where the field has a message index (only an error pays for it)."""
        try:
            yield
        except DataError as error:
            respelled = self._as_written(error)
            if respelled is None:
                raise
            raise type(error)(respelled) from None

    def _as_written(self, error: DataError) -> str | None:
        message = str(error)
        found = _FIELD_IN_MESSAGE.match(message)
        if found is None or getattr(error, _IN_FILE_TERMS, False):
            return None
        where, field = found["where"], found["field"]
        index = next((i for i, file in enumerate(self.files) if where.startswith(f"{file.path}:")), None)
        if index is None or self.formats[index].format.name == "messages":
            return None
        record = None
        if field != "messages":  # a message's index: which turn it is depends on the record
            record = next((raw for _, at, raw in rows(self.files[index]) if at == where), None)
        spelled = self.formats[index].format.field_as_written(field, record)
        return f"{where}: field {spelled}{message[found.end() :]}"


_IN_FILE_TERMS = "_rankflow_in_file_terms"
"""Set on a DataError that already names the file's own fields (its reader's or its format's)."""


@contextlib.contextmanager
def _file_terms() -> Iterator[None]:
    try:
        yield
    except DataError as error:
        setattr(error, _IN_FILE_TERMS, True)
        raise


def _in_file_terms(records: Iterator[tuple[int, str, Any]]) -> Iterator[tuple[int, str, Any]]:
    with _file_terms():
        yield from records


_FIELD_IN_MESSAGE = re.compile(r"(?P<where>.+?): field (?P<field>messages(?:\.\d+(?:\.\w+)?)?)(?=[:\s,;]|$)", re.DOTALL)


def _first_record_format(file: DataFile) -> FileFormat:
    for _, where, record in rows(file):
        return FileFormat.of_first_record(record, where)
    return FileFormat.default()


def source_of(files: Sequence[DataFile], data_format: str = "auto", format_option: str = "data.format") -> DataSource:
    """`files` with each one's format: `data_format` ("auto": each file's first record's); files of two formats
    are a DataError naming both."""
    if data_format != "auto":
        return DataSource(tuple(files), tuple(FileFormat.set_by_config(data_format, format_option) for _ in files))
    formats = [_first_record_format(file) for file in files]
    detected = [f for f in formats if f.first_where is not None]
    for other in detected[1:]:
        if other.format is not detected[0].format:
            raise DataError(
                f"{other.first_where}: a {other.format.title} record, but {detected[0].first_where} is a "
                f"{detected[0].format.title} record (each file's format is its first record's); the files of {files[0].key} share one format: convert one of "
                f"them, or leave it out of {files[0].key}"
            )
    return DataSource(tuple(files), tuple(formats))


def open_source(
    path: DataPath, data_format: str = "auto", key: str = "data.path", format_option: str = "data.format"
) -> DataSource:
    """The data `path` (a resolved `data.path`, or `data.eval_path`: `key`) names, read in `data_format` (see
    `source_of`; `format_option` is what set it, as messages name it)."""
    return source_of(data_files(path, key=key), data_format, format_option)


def iter_source(source: DataSource) -> Iterator[Record]:
    """Parse, convert and validate every record of `source`, one at a time; the first problem raises DataError.

    An empty file is an error too, so a file that was meant to hold data never
    goes missing silently."""
    first: Record | None = None
    for file_index, (file, file_format) in enumerate(zip(source.files, source.formats, strict=True)):
        num_records = 0
        for position, where, raw in _in_file_terms(rows(file)):
            with _file_terms():  # the format's own checks name the file's fields already
                converted = file_format.to_messages(raw, where)
            conversation = validate_record(converted, where)
            if first is not None and conversation.is_trajectory != first.conversation.is_trajectory:
                kind = (
                    "an RL trajectory (it has a reward or an advantage)"
                    if first.conversation.is_trajectory
                    else "an SFT conversation (no reward or advantage)"
                )
                raise DataError(
                    f"{where}: field reward: {first.where} is {kind} but this record is not; "
                    "the data holds one kind of record, so split the file or complete this record"
                )
            record = Record(where=where, conversation=conversation, position=position, file_index=file_index)
            first = first or record
            num_records += 1
            yield record
        if not num_records:
            raise DataError(
                f"{file.path}: no conversations found, the file is empty; add records to it, or leave it out of "
                f"{file.key}"
            )


def iter_records(path: DataPath, data_format: str = "auto") -> Iterator[Record]:
    """The validated records of the files `path` names (see `open_source`, `iter_source`)."""
    return iter_source(open_source(path, data_format))


def read_records(path: DataPath, data_format: str = "auto") -> list[Record]:
    """Every record in memory (see `iter_records`); the first problem raises DataError."""
    return list(iter_records(path, data_format))


def read_conversations(path: DataPath, data_format: str = "auto") -> list[Conversation]:
    """The validated conversations, without where they came from."""
    return [record.conversation for record in read_records(path, data_format)]
