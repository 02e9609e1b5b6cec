"""MANIFEST.json: every file of a checkpoint with its size and sha256.

The manifest is the checkpoint's commit record: it is written last when staging
and uploaded last when committing, so a checkpoint without a manifest that
verifies is, by definition, not there.
"""

from __future__ import annotations

import json
from pathlib import Path

from .files import sha256_file, write_text_atomic

MANIFEST_FILE = "MANIFEST.json"


def build_manifest(directory: Path, extra: dict | None = None) -> dict:
    files = [
        {"path": p.relative_to(directory).as_posix(), "size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST_FILE
    ]
    return {"format": "rankflow-checkpoint/1", "files": files, **(extra or {})}


def write_manifest(directory: Path, extra: dict | None = None) -> dict:
    manifest = build_manifest(directory, extra)
    write_text_atomic(directory / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def verify_staged(directory: Path) -> dict | None:
    """The manifest if every listed file is present with its size and digest, else None."""
    path = directory / MANIFEST_FILE
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    for entry in manifest["files"]:
        file = directory / entry["path"]
        if not file.is_file() or file.stat().st_size != entry["size"] or sha256_file(file) != entry["sha256"]:
            return None
    return manifest
