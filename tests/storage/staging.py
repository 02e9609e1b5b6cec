"""A staged checkpoint for commit tests: random data files and the manifest that names them."""

from __future__ import annotations

import os
from pathlib import Path

from trainer_core.run.manifest import write_manifest


def stage_checkpoint(tmp_path: Path, run_id: str, step: int, *, num_files: int = 4, file_bytes: int = 200_000) -> Path:
    """`tmp_path/staged` with `model-0000N.safetensors` files of random bytes and their manifest."""
    staged = tmp_path / "staged"
    staged.mkdir()
    for index in range(num_files):
        (staged / f"model-{index:05d}.safetensors").write_bytes(os.urandom(file_bytes))
    write_manifest(staged, {"run_id": run_id, "step": step})
    return staged
