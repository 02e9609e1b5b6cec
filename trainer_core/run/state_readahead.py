"""Read a saved state into the page cache beside the next launch's start, so its ranks load it from memory.

A state is written past the page cache (`trainer_core.direct_write`), so the
next segment's ranks would read it from the disk: the weights as they are
restored, the AdamW moments page by page as the first step touches their
maps. Started when the next segment's task begins, a background read fills
the cache while the orchestrator checks the inputs and the launch starts its
ranks (about 2.5 s here). Filling the page cache ran at about 0.4 GB/s on
this project's machines (2 GB in 4.8 s), so that hides about 1 GB, the
weights first; the rest is read as the ranks ask for it.

It reads only what fits: a state larger than half of the memory available
now (or when that is unknown) is left to be read on demand (reading it
ahead would evict the pages the ranks are about to use). Nothing depends on it: a file that vanishes or
fails to read is skipped.
"""

from __future__ import annotations

import threading
from pathlib import Path

from trainer_core.run.plan_size import available_memory_bytes

BLOCK_BYTES = 8 * 2**20


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
    available = available_memory_bytes()
    if not files or available is None or sum(files.values()) > available // 2:
        return None
    reader = threading.Thread(target=_read, args=(list(files),), name=f"read-ahead-{state_dir.name}", daemon=True)
    reader.start()
    return reader
