"""Read committed checkpoints: list, resolve LATEST, download and verify.

A checkpoint is visible only when its MANIFEST.json exists and every file it
lists is present with the listed size; a download also checks every sha256.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .publication import MANIFEST_FILE, checkpoint_name, read_latest
from .storage import StoreLocation


def read_manifest(store: StoreLocation, run_id: str, name: str) -> dict | None:
    path = store.path(run_id, "checkpoints", name, MANIFEST_FILE)
    if not store.fs.exists(path):
        return None
    return json.loads(store.fs.cat_file(path))


def is_complete(store: StoreLocation, run_id: str, name: str) -> bool:
    manifest = read_manifest(store, run_id, name)
    if manifest is None:
        return False
    base = store.path(run_id, "checkpoints", name)
    for entry in manifest["files"]:
        path = f"{base}/{entry['path']}"
        if not store.fs.exists(path) or int(store.fs.info(path)["size"]) != entry["size"]:
            return False
    return True


def list_checkpoints(store: StoreLocation, run_id: str) -> list[str]:
    """Names of the complete checkpoints of a run, oldest first."""
    root = store.path(run_id, "checkpoints")
    if not store.fs.exists(root):
        return []
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in store.fs.ls(root, detail=False))
    return [n for n in names if n.startswith("step-") and is_complete(store, run_id, n)]


def latest_checkpoint(store: StoreLocation, run_id: str) -> str | None:
    latest = read_latest(store, run_id)
    if latest is None:
        return None
    name = checkpoint_name(int(latest["step"]))
    return name if is_complete(store, run_id, name) else None


def download_checkpoint(store: StoreLocation, run_id: str, name: str, dest: Path) -> Path:
    """Download a committed checkpoint and verify every file's sha256."""
    manifest = read_manifest(store, run_id, name)
    if manifest is None:
        raise FileNotFoundError(f"checkpoint {name} of run {run_id} has no manifest at {store.url}; it is not committed")
    base = store.path(run_id, "checkpoints", name)
    dest.mkdir(parents=True, exist_ok=True)
    for entry in manifest["files"]:
        target = dest / entry["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        store.fs.get_file(f"{base}/{entry['path']}", str(target))
        digest = hashlib.sha256(target.read_bytes()).hexdigest()
        if digest != entry["sha256"]:
            raise OSError(f"{base}/{entry['path']}: sha256 {digest} does not match the manifest; the object is corrupt")
    (dest / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return dest
