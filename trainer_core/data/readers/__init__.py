"""Rows of one data file, each a decoded record with its position: one reader per file type.

    jsonl             readers/jsonl.py     lines, from 1 (blank lines skipped)
    parquet, arrow    readers/columnar.py  rows, from 0, through Hugging Face `datasets` (streamed)

A reader yields `(position, where, record)` in file order (`where`: the
position as messages name it) and holds one record (or
one record batch) at a time; a file that cannot be read as its type is a
DataError naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ...data_sources import DataFile, FileType
from .columnar import columnar_rows
from .jsonl import jsonl_rows

Rows = Callable[[DataFile], Iterator[tuple[int, str, Any]]]
READERS: dict[FileType, Rows] = {"jsonl": jsonl_rows, "parquet": columnar_rows, "arrow": columnar_rows}


def rows(file: DataFile) -> Iterator[tuple[int, str, Any]]:
    """The file's records with their positions, by its type's reader."""
    return READERS[file.type](file)


__all__ = ["READERS", "rows"]
