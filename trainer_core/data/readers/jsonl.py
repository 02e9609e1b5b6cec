"""JSONL: one JSON object a line, read line by line (the plan's fast path: no `datasets`, nothing cached).

`datasets`' own JSON builder would parse the file into an Arrow cache first; a
line's number, its UTF-8 and JSON errors and its lone surrogate escapes would
be lost on the way, and the bytes cached twice. So JSONL stays this reader.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ...data_sources import DataFile
from ..schema import decode_line


def jsonl_rows(file: DataFile) -> Iterator[tuple[int, str, Any]]:
    with file.open() as handle:
        for line_number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue  # blank lines (often a trailing newline) carry nothing
            where = file.where(line_number)
            yield line_number, where, decode_line(raw, where)
