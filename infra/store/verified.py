"""Verified, streaming downloads: an object to a local file, hashed as it streams, placed only if it matches.

An object is read in blocks of `BLOCK_BYTES` (never whole into memory: a
training state can be many GiB), each block hashed and written to a temporary
file beside the target; the temporary file takes the target's name only when
the size and sha256 match the manifest entry. A mismatch raises
`StoredObjectCorrupt` naming the object: a corrupt store is reported, never
used. `local_copy_matches` is the check a cache applies before trusting a
local file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import BinaryIO, cast

from trainer_core.files import size_and_sha256
from trainer_core.run.manifest import FileEntry

from .base import ObjectStore, location_of
from .durable import temp_name

BLOCK_BYTES = 4 * 2**20
"""Bytes read (and held) at a time when streaming an object or hashing a file."""


class StoredObjectCorrupt(OSError):
    """An object in the store does not match its manifest entry (size or sha256).

    An OSError like any storage failure: the bytes may have been damaged in
    transit, so a retry (which downloads again) can help; a damaged object
    fails every retry with the same message naming it.
    """


def sha256_of_file(path: Path) -> tuple[int, str]:
    """(size, sha256) of a local file, read in blocks."""
    return size_and_sha256(path)


def local_copy_matches(path: Path, entry: FileEntry) -> bool:
    """Whether `path` is a regular file with the entry's size and sha256 (size first: no hashing a wrong size)."""
    if path.is_symlink() or not path.is_file() or path.stat().st_size != entry.size:
        return False
    return sha256_of_file(path) == (entry.size, entry.sha256)


def fetch_verified(store: ObjectStore, remote_path: str, target: Path, entry: FileEntry) -> int:
    """Stream `remote_path` into `target`, verifying it against `entry`; returns the bytes written.

    Raises StoredObjectCorrupt (naming the object) when the bytes do not match;
    `target` is then left as it was.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(target)
    digest, size = hashlib.sha256(), 0
    try:
        # Mode "rb": a binary file (fsspec's inferred type also names a text one).
        source_file = cast(
            "BinaryIO", location_of(store).fs.open(remote_path, "rb", block_size=BLOCK_BYTES, cache_type="none")
        )
        with source_file as source, tmp.open("wb") as sink:
            while block := source.read(BLOCK_BYTES):
                digest.update(block)
                size += len(block)
                sink.write(block)
        if (size, digest.hexdigest()) != (entry.size, entry.sha256):
            where = store.url_of(store.key_of(remote_path))
            raise StoredObjectCorrupt(
                f"{where}: {size} bytes with sha256 {digest.hexdigest()} do not match its manifest ({entry.size} "
                f"bytes, sha256 {entry.sha256}); the stored object is corrupt and was not used"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return size
