"""MANIFEST.json: every file of a checkpoint with its size and sha256, and its provenance.

The manifest is the checkpoint's commit record: it is written last when staging
and uploaded last when committing, so a checkpoint without a manifest that
verifies is, by definition, not there.

Format `rankflow-checkpoint/2` (written here) adds provenance to version 1:
`run_id`, `step`, `plan_digest`, `parent_checkpoint` (the checkpoint the
weights were trained from, or null for the run's first), `world_size` and
`logical_dp`. Readers (infra/manifests.py) accept both versions. The file list
is generic: whatever the export staged (full weights, adapters, heads,
tokenizer) is listed the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

from .files import sha256_file, write_text_atomic

MANIFEST_FILE = "MANIFEST.json"
MANIFEST_FORMAT = "rankflow-checkpoint/2"


def staged_files(directory: Path) -> list[Path]:
    """The files of a staged checkpoint (all but the manifest), in a stable order."""
    return [p for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST_FILE]


def file_entry(directory: Path, path: Path) -> dict:
    return {"path": path.relative_to(directory).as_posix(), "size": path.stat().st_size, "sha256": sha256_file(path)}


def manifest_from_entries(entries: list[dict], extra: dict | None = None) -> dict:
    return {"format": MANIFEST_FORMAT, "files": sorted(entries, key=lambda e: e["path"]), **(extra or {})}


def build_manifest(directory: Path, extra: dict | None = None) -> dict:
    return manifest_from_entries([file_entry(directory, p) for p in staged_files(directory)], extra)


def write_manifest_dict(directory: Path, manifest: dict) -> dict:
    write_text_atomic(directory / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def write_manifest(directory: Path, extra: dict | None = None) -> dict:
    return write_manifest_dict(directory, build_manifest(directory, extra))


def verify_staged(directory: Path) -> dict | None:
    """The manifest if every listed file is present with its size and digest, else None."""
    path = directory / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        entries = manifest["files"]
    except (ValueError, KeyError, TypeError):
        return None
    root = directory.resolve()
    for entry in entries:
        file = directory / entry["path"]
        if root not in file.resolve().parents:
            return None  # a path that leaves the staging is never "verified"
        if not file.is_file() or file.stat().st_size != entry["size"] or sha256_file(file) != entry["sha256"]:
            return None
    return manifest
