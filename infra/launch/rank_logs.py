"""Each rank's output, read from its own file and forwarded as whole lines.

torchrun (`--redirects=3 --log-dir=D`) writes every rank's stdout and stderr to
files of their own, `D/<run>/attempt_<n>/<local rank>/std{out,err}.log`, at the
file-descriptor level, so C++ output and warnings are captured too. Reading
each rank's files separately means two ranks' lines can never merge into one
record, however the ranks write (print writes the text and the newline
separately). Lines are forwarded with the rank named (`[rank R] …`), and the
last lines of each rank are kept for failure reports.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable
from pathlib import Path

_RANK_PREFIX = re.compile(r"^\[rank (\d+)\] ")


class RankLogTail:
    """Follow every rank's log files under a torchrun log dir."""

    def __init__(self, log_dir: Path, on_line: Callable[[str], None], tail_lines: int = 60) -> None:
        self.log_dir = log_dir
        self._on_line = on_line
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self._tail_lines = tail_lines
        self.tails: dict[int, deque[str]] = {}

    def _files(self) -> list[tuple[int, Path]]:
        found = []
        for path in self.log_dir.glob("*/attempt_*/*/std*.log"):
            if path.parent.name.isdigit():
                found.append((int(path.parent.name), path))
        return sorted(found)

    def poll(self, final: bool = False) -> None:
        """Forward the complete lines written since the last poll (and, when final, any unfinished one)."""
        for rank, path in self._files():
            try:
                with path.open("rb") as handle:
                    handle.seek(self._offsets.get(path, 0))
                    chunk = handle.read()
            except OSError:
                continue
            self._offsets[path] = self._offsets.get(path, 0) + len(chunk)
            lines = (self._partial.get(path, b"") + chunk).split(b"\n")
            self._partial[path] = b"" if final else lines.pop()
            for raw in lines:
                if raw or not final:
                    self._emit(rank, raw.decode("utf-8", "replace").rstrip("\r"))

    def _emit(self, rank: int, text: str) -> None:
        match = _RANK_PREFIX.match(text)
        # Files are named by local rank; on node K of several, the global rank is the one a rank prints.
        if match:
            rank = int(match.group(1))
        line = text if match else f"[rank {rank}] {text}"
        self.tails.setdefault(rank, deque(maxlen=self._tail_lines)).append(line)
        self._on_line(line)

    def last_lines(self, rank: int) -> tuple[str, ...]:
        return tuple(self.tails.get(rank, ()))
