"""Staged checkpoints for publication tests: files, a manifest, and ways to spoil them."""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainer_core.run.manifest import write_manifest

RUN = "run-abc"


def stage(root: Path, step: int, files: dict[str, bytes], run_id: str = RUN, name: str | None = None) -> Path:
    """A staging directory as the export leaves it: the files, then MANIFEST.json (format 2)."""
    staged = root / "staging" / (name or f"step-{step:08d}")
    staged.mkdir(parents=True)
    for relative, data in files.items():
        (staged / relative).parent.mkdir(parents=True, exist_ok=True)
        (staged / relative).write_bytes(data)
    write_manifest(
        staged, {"run_id": run_id, "step": step, "plan_digest": "d" * 64, "parent_checkpoint": None, "world_size": 1}
    )
    return staged


def random_files(num_files: int, size: int, prefix: str = "model") -> dict[str, bytes]:
    return {f"{prefix}-{index:05d}-of-{num_files:05d}.safetensors": os.urandom(size) for index in range(num_files)}


def rewrite_manifest(staged: Path, change) -> None:
    """Apply `change(manifest_dict)` to a staged manifest (a hostile or broken export)."""
    path = staged / "MANIFEST.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def same_size_other_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def fail_after_uploads(num_uploads: int, error: BaseException):
    """A commit observer that raises `error` once `num_uploads` files have landed (an outage, a crash)."""
    landed: list[str] = []

    def observe(event: str) -> None:
        if event.startswith("uploaded "):
            landed.append(event)
            if len(landed) == num_uploads:
                raise error

    return observe
