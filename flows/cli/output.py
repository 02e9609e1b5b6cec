"""Standard output, where every command prints its result: refused up front when closed, and a lost write
reported as one line.

A command started with standard output closed (`>&-`) would print its result to nowhere and exit 0 (Python sets
`sys.stdout` to None), and a file the command opens could take descriptor 1; it is refused before anything runs.
A result line that cannot be written (`>/dev/full`, a reader that closed its pipe) ends the command with exit 1
and one line on standard error instead of a traceback: the work itself (a committed checkpoint) stands, only its
report was lost.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from trainer_core.errors import BadInputError


class OutputLost(Exception):
    """Standard output refused the command's result (a full disk, a closed pipe)."""


def require_stdout() -> None:
    """Refuse to start with standard output closed (bad input: exit 2, nothing done)."""
    if sys.stdout is None:
        raise BadInputError(
            "standard output is closed, and the command prints its result there; run it with standard output "
            "open (a terminal, a file: > result.txt, or a pipe)"
        )


class _Guarded:
    """Standard output whose refused writes raise OutputLost: not an OSError, so no handler of storage failures
    (`except OSError`) reports a full disk on standard output as the store's."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as error:
            raise _lost(error) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as error:
            raise _lost(error) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextmanager
def guarded_stdout() -> Iterator[None]:
    """Standard output guarded (see `_Guarded`) while a command runs; as it was afterwards."""
    original = sys.stdout
    sys.stdout = _Guarded(original)  # pyright: ignore[reportAttributeAccessIssue]
    try:
        yield
    finally:
        sys.stdout = original


def emit(line: str) -> None:
    """Print `line` and flush it now: under `guarded_stdout`, a refused write raises OutputLost here."""
    print(line, flush=True)


def flush_stdout() -> None:
    """Flush what the command printed (under `guarded_stdout`: OutputLost when standard output refuses it)."""
    if sys.stdout is not None:
        sys.stdout.flush()


def _lost(error: OSError) -> OutputLost:
    # Nothing more can reach standard output: point it at /dev/null so the interpreter's own flush at exit
    # does not print an "Exception ignored" traceback after our one line.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass
    reason = error.strerror or type(error).__name__
    return OutputLost(
        f"could not write the result to standard output ({reason}); the command's work is done but its result "
        "line is lost: write standard output to a file with space, or to a reader that stays open"
    )
