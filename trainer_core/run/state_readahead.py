"""Read a saved state into the page cache beside the next launch's start, so its ranks load it from memory.

A state is written past the page cache (`trainer_core.direct_write`), so the
next segment's ranks would read it from the disk: the weights as they are
restored, the AdamW moments page by page as the first step touches their
maps. Started when the next segment's task begins, a background read fills
the cache while the orchestrator checks the inputs and the launch starts its
ranks (about 2 s here): on this machine's disk (2 GB/s read) that hides
about 4 GB; a larger state's remainder is read at the disk's rate as before.

It reads only what fits: a state larger than half of the memory available
now is left to be read on demand (reading it ahead would evict the pages the
ranks are about to use). Nothing depends on it: a file that vanishes or
fails to read is skipped.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

BLOCK_BYTES = 8 * 2**20


def available_memory_bytes() -> int:
    """MemAvailable (free memory and reclaimable cache), or the free pages where /proc/meminfo is not."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _files(state_dir: Path) -> dict[Path, int]:
    """Each regular file under `state_dir` and its size, smallest first (nothing where the directory is gone or
    changing). Smallest first: the weights (a third of a full fine-tune's state) are restored before the ranks
    are ready, the AdamW moments only paged in by the first step."""
    try:
        sizes = {p: p.stat().st_size for p in state_dir.rglob("*") if p.is_file() and not p.is_symlink()}
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


def read_ahead(state_dir: Path) -> threading.Thread | None:
    """Start reading `state_dir`'s files into the page cache in a daemon thread; None where nothing is read."""
    files = _files(state_dir)
    if not files or sum(files.values()) > available_memory_bytes() // 2:
        return None
    reader = threading.Thread(target=_read, args=(list(files),), name=f"read-ahead-{state_dir.name}", daemon=True)
    reader.start()
    return reader
