"""Which trainer-core lines become Prefect log rows: the ones a person reads, at a bounded rate.

Every line of every rank is kept in the launch's log files (RUN_DIR/logs/…,
one file per rank, and uploaded to the store next to the run: `tasks.launch_logs`);
Prefect, whose log table self-hosted users prune themselves, gets only:

- every warning and error of every rank and of torchrun itself, with the
  whole traceback that follows an error;
- rank 0's step lines, at most one per `STEP_LINE_EVERY_S` (its segment
  summary line gives the last loss anyway);
- rank 0's other lines (a segment's set-up and summary, an export's phases): a
  few per launch.

Other ranks' ordinary lines are not sent. A segment of T seconds so writes at
most T / 30 + about 5 rows, whatever its step rate.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Protocol

__all__ = ["STEP_LINE_EVERY_S", "PersonLines", "rank_line_logger"]

STEP_LINE_EVERY_S = 30.0

_SOURCE = re.compile(r"^((?:\[node \d+\] )?)(?:\[rank (\d+)\] )?")
_STEP = re.compile(r"^step \d+ ")
_ERROR = re.compile(r"\bERROR\b|\bCRITICAL\b|^Traceback \(most recent call last\)|^[EF]\d{4} |^\w*(Error|Exception)\b")
_WARNING = re.compile(r"\bWARN(ING)?\b|\b\w*Warning\b|^W\d{4} ")
_TRACEBACK_GLUE = ("During handling of the above exception", "The above exception was the direct cause", "Traceback")


class _Logger(Protocol):
    def info(self, msg: str, /) -> object: ...
    def warning(self, msg: str, /) -> object: ...
    def error(self, msg: str, /) -> object: ...


class PersonLines:
    """Forward to `logger` the launch lines a person reads (see the module docstring); drop the rest."""

    def __init__(
        self, logger: _Logger, every_s: float = STEP_LINE_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._logger = logger
        self._every_s = every_s
        self._clock = clock
        self._last_step: dict[str, float] = {}
        self._in_traceback: set[str] = set()

    def __call__(self, line: str) -> None:
        if not line.strip():
            return
        source = _SOURCE.match(line)
        assert source is not None  # every group is optional
        node, rank = source[1], source[2]
        text = line[source.end() :]
        who = f"{node}{rank}"
        if who in self._in_traceback:
            self._logger.error(line)
            # A traceback ends with its first unindented line that does not chain another one.
            if not text.startswith((" ", "\t")) and not text.startswith(_TRACEBACK_GLUE):
                self._in_traceback.discard(who)
            return
        if _ERROR.search(text):
            if text.startswith("Traceback"):
                self._in_traceback.add(who)
            self._logger.error(line)
        elif _WARNING.search(text):
            self._logger.warning(line)
        elif rank == "0" and _STEP.match(text):
            now = self._clock()
            if now - self._last_step.get(node, -self._every_s) >= self._every_s:
                self._last_step[node] = now
                self._logger.info(line)
        elif rank == "0":
            self._logger.info(line)


def rank_line_logger() -> Callable[[str], None]:
    """A line sink for a launch inside a Prefect run: `PersonLines` on the run's logger."""
    from prefect import get_run_logger

    return PersonLines(get_run_logger())  # pyright: ignore[reportArgumentType]
