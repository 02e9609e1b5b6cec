"""Files and digests the trainer core shares: atomic text writes, sha256 of files and of tensors."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

import torch


def write_text_atomic(path: Path, text: str) -> None:
    """Write aside and rename: a reader sees the old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


HASH_BLOCK_BYTES = 4 * 2**20
"""Bytes read at a time while hashing a file: large enough that the hash, not the calls, costs the time."""


def size_and_sha256(path: Path) -> tuple[int, str]:
    """(size, sha256) of a local file, read in blocks: the one file hash of rankflow's local files."""
    digest, size = hashlib.sha256(), 0
    with path.open("rb") as handle:
        while block := handle.read(HASH_BLOCK_BYTES):
            digest.update(block)
            size += len(block)
    return size, digest.hexdigest()


def sha256_file(path: Path) -> str:
    return size_and_sha256(path)[1]


def tensors_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the names and raw bytes of named tensors, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        # The buffer itself, not a bytes copy: a plan hashes each segment's shard, and a copy would double it.
        digest.update(tensors[name].detach().cpu().contiguous().view(torch.uint8).numpy().data)
    return digest.hexdigest()
