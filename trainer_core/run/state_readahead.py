"""Read a saved state's weights into the page cache beside the next launch's start, so its ranks copy them from memory.

A state is written past the page cache (`trainer_core.direct_write`), so the
next segment's ranks would read it from the disk. The weights are restored
before the ranks are ready (a memory map of the file, copied into the
parameters); read ahead, they come from memory. The read starts when the
segment that saved the state reports it saved (`ReadAheadWhenSaved`, on its
task's watch of the progress records), and runs while its ranks exit, the
orchestrator checks the next segment's inputs and the next launch starts its
ranks (about 2.5 s here); the next segment's task joins that read, or starts
one where none ran here. The AdamW moments, two thirds of a full fine-tune's
state, are not read ahead where a launch runs one rank per node: it reads
them past the cache itself, beside the first forward and backward
(`trainer_core.safetensors_read`). Several ranks per node read them through
the cache, which then serves them all from one read of the disk, so they are
read ahead too.
Sharded states (DCP's files, read through the cache) are read ahead whole.
Filling the page cache ran at 0.3–1.2 GB/s on this project's machines.

It reads only what fits: files that together take more than half of the
memory available now (or when that is unknown) are left to be read on demand (reading them ahead
would evict the pages the ranks are about to use). Nothing depends on it: a
file that vanishes or fails to read is skipped.
"""

from __future__ import annotations

import threading
from pathlib import Path

from trainer_core.run.plan_size import available_memory_bytes
from trainer_core.training.checkpoint_io import OPTIMIZER_FILE

BLOCK_BYTES = 8 * 2**20


def _files(state_dir: Path, moments: bool) -> dict[Path, int]:
    """Each regular file under `state_dir` the ranks read through the page cache (the AdamW moments' files only
    where `moments`), and its size, smallest first; nothing where the directory is gone or changing."""
    try:
        sizes = {
            p: p.stat().st_size
            for p in state_dir.rglob("*")
            if p.is_file() and not p.is_symlink() and (moments or p.name != OPTIMIZER_FILE)
        }
    except OSError:
        return {}
    return dict(sorted(sizes.items(), key=lambda item: (item[1], str(item[0]))))


def _read(files: list[Path]) -> None:
    block = bytearray(BLOCK_BYTES)
    for path in files:
        try:
            with path.open("rb", buffering=0) as handle:
                while handle.readinto(block):
                    pass
        except OSError:
            continue  # removed, or unreadable: the ranks' own read reports what matters


_readers: dict[Path, threading.Thread] = {}
_readers_lock = threading.Lock()


def read_ahead(state_dir: Path, *, moments: bool = False) -> threading.Thread | None:
    """Start reading `state_dir`'s files into the page cache in a daemon thread; None where nothing is read.
    `moments`: the AdamW moments' files too (a launch of several ranks per node reads them through the cache,
    once for all). A state read ahead once in this process (started at its save) is not read again: that
    reader is returned."""
    with _readers_lock:
        if state_dir in _readers:
            return _readers[state_dir]
        files = _files(state_dir, moments)
        available = available_memory_bytes()
        if not files or available is None or sum(files.values()) > available // 2:
            return None
        reader = threading.Thread(target=_read, args=(list(files),), name=f"read-ahead-{state_dir.name}", daemon=True)
        reader.start()
        _readers[state_dir] = reader
        return reader


class ReadAheadWhenSaved:
    """A progress-record consumer for segment K's watch: starts reading K's state ahead at its `saved` record.

    The next segment's task would start it too, but only after K's ranks have exited and the task has returned
    (0.5–0.8 s at 2 GB on this project's machines); from the save, the read runs beside that as well.
    """

    def __init__(self, state_dir: Path, *, moments: bool = False) -> None:
        self.state_dir, self.moments = state_dir, moments
        self.asked = False
        self.started: threading.Thread | None = None

    def __call__(self, records: list[dict]) -> None:
        if self.asked or not any(record.get("event") == "saved" for record in records):
            return
        self.asked = True
        try:
            self.started = read_ahead(self.state_dir, moments=self.moments)
        except Exception:  # noqa: BLE001 - nothing depends on it: never fail the launch that watches
            self.started = None
