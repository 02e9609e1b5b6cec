"""The record formats a data file may hold, each turned into the messages format before validation.

    messages           {"messages": [{"role", "content", …}, …]}            (schema.py; RL trajectories too)
    sharegpt           {"conversations": [{"from", "value"}, …]}            (sharegpt.py)
    prompt_completion  {"prompt": "…", "completion": "…"}                   (prompt_completion.py)

A format is one `RecordFormat` in `FORMATS`: its name, the top-level fields
that mark a record as its own, and `to_messages`. Converting first is what
keeps every later stage (rendering, masking, RL alignment) unchanged: they
only ever see messages records. With `data.format = "auto"` each file's format
is its first record's (detection.py), and a record of another format in the
file is an error naming its row and the field that gives it away.
"""

from __future__ import annotations

from .base import FormatName, RecordFormat
from .messages import MESSAGES
from .prompt_completion import PROMPT_COMPLETION
from .sharegpt import SHAREGPT

FORMATS: dict[str, RecordFormat] = {fmt.name: fmt for fmt in (MESSAGES, SHAREGPT, PROMPT_COMPLETION)}

__all__ = ["FORMATS", "FormatName", "RecordFormat"]
