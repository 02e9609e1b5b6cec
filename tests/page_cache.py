"""How much of a file the page cache holds (mincore(2)), for tests of what is written past it or read into it."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path


def resident_pages(path: Path) -> int:
    """Pages of `path` in the page cache: mincore(2) over a shared read-only map of the file."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    vector = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    with path.open("rb") as handle:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, handle.fileno(), 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            assert libc.mincore(address, size, vector) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(address, size)
    return sum(page & 1 for page in vector)
