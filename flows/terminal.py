"""What `rankflow run` shows on the terminal: Prefect's log lines, without tracebacks.

A failed launch used to print seven tracebacks before the one line that
mattered: each rank's, torchrun's own (its ChildFailedError banner), and
Prefect's for the task and again for the flow, some of them inside long
exception messages. They all stay where they are useful — the ranks' log
files, `RUN_DIR/logs/failures/` (`tasks.failure_report`) and the Prefect API,
which still gets every record whole — and the terminal gets each record as
one line: no traceback frames, no exception text after a record's first
line. The run's result is the CLI's own last line.

`quiet_tracebacks()` changes only Prefect's console handler (and only in the
process that calls it): a filter drops the lines of tracebacks streamed
line by line (`[rank N] Traceback …` and its frames, torchrun's banner), and
a formatter prints each other record as its first line, without exc_info.
"""

from __future__ import annotations

import copy
import logging
import re

_MAX_CHARS = 400
"""A console line longer than this is cut (an exception's repr can hold a whole launch's last lines)."""
_SOURCE = re.compile(r"^(\[rank \d+\] )?(.*)$", re.DOTALL)
_BANNER = "=" * 20
_CHAINED = ("The above exception was the direct cause", "During handling of the above exception")
# What Prefect says after an exception's repr: kept when the repr itself is cut.
_RETRY_NOTE = re.compile(r" - (Retry \d+/\d+ will start .*|Retries are exhausted)$")


class _TracebackLines(logging.Filter):
    """Drop the lines of tracebacks that arrive one record per line (rank and torchrun output)."""

    def __init__(self) -> None:
        super().__init__()
        self._state: dict[tuple, str] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot format is the formatter's problem, not ours
            return True
        match = _SOURCE.match(message)
        assert match is not None  # the pattern matches every string
        source, body = match.groups()
        key = (record.name, getattr(record, "task_run_id", None), source)
        state = self._state.get(key)
        if body.startswith("Traceback (most recent call last):") or body.endswith("(most recent call first):"):
            self._state[key] = "frames"  # a traceback, or a faulthandler stack dump
            return False
        if state == "frames":
            if body[:1] in (" ", "\t") or not body.strip():
                return False
            self._state[key] = "after"  # the exception's own line closes the frames
            return False
        if state == "after":
            if body.startswith(_CHAINED) or not body.strip():
                return False
            if body.startswith(_BANNER):  # torchrun's ChildFailedError: a banner block follows its traceback
                self._state[key] = "banner"
                return False
            del self._state[key]
            return True
        if state == "banner":
            if body.startswith(_BANNER):
                del self._state[key]
            return False
        return True


class _OneLine(logging.Formatter):
    """Format a record with the console's own formatter, as one line and without its traceback."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self._inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        shown = copy.copy(record)  # the API handler formats the same record: leave it whole
        try:
            message = shown.getMessage()
        except Exception:  # noqa: BLE001
            return self._inner.format(record)
        first = message.split("\n", 1)[0].split("\\n", 1)[0]  # a repr'd message keeps its newlines escaped
        if len(first) > _MAX_CHARS:
            first = first[:_MAX_CHARS] + " …"
        note = _RETRY_NOTE.search(message)
        if first != message and note is not None and not first.endswith(note[0]):
            first = f"{first} …{note[0]}"
        shown.msg, shown.args = first, None
        shown.exc_info, shown.exc_text, shown.stack_info = None, None, None
        return self._inner.format(shown)


def _console_handlers() -> list[logging.Handler]:
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger()] + [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)]
    handlers = {
        id(h): h for logger in loggers for h in getattr(logger, "handlers", []) if isinstance(h, PrefectConsoleHandler)
    }
    return list(handlers.values())


def quiet_tracebacks(handlers: list[logging.Handler] | None = None) -> int:
    """Make Prefect's console handlers (or `handlers`) print one line per record and no tracebacks; returns how many."""
    handlers = _console_handlers() if handlers is None else handlers
    for handler in handlers:
        if not isinstance(handler.formatter, _OneLine):
            handler.setFormatter(_OneLine(handler.formatter))
            handler.addFilter(_TracebackLines())
    return len(handlers)
