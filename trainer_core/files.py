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


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tensors_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the names and raw bytes of named tensors, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        # The buffer itself, not a bytes copy: a plan hashes each segment's shard, and a copy would double it.
        digest.update(tensors[name].detach().cpu().contiguous().view(torch.uint8).numpy().data)
    return digest.hexdigest()
