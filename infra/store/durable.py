"""Durable local writes: a reader sees the old file or the new one, and a crash keeps what returned.

Write to a temporary file in the same directory, fsync it, rename it over the
target (atomic on POSIX), then fsync the directory so that the rename itself
survives a power cut. `create_exclusive` publishes a fully written file under
a name only if that name is free (os.link fails when it exists), the local
counterpart of S3's `If-None-Match: *`.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

TEMP_MARKER = ".rankflow-tmp-"
"""Part of every temporary name written here, so that garbage collection can find leftovers."""


def temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}{TEMP_MARKER}{os.getpid()}-{secrets.token_hex(4)}")


def fsync_dir(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _write_temp(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return tmp


def write_durable(path: Path, data: bytes) -> None:
    """Atomically replace `path` with `data`, fsynced (file and directory)."""
    tmp = _write_temp(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def create_exclusive(path: Path, data: bytes) -> bool:
    """Publish `data` at `path` only if nothing is there; False if something already is."""
    tmp = _write_temp(path, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True
