"""Training state between segments: weights, optimizer state and the data cursor.

Rank 0 writes the state into a temporary directory and renames it into place,
so a state directory either exists whole or not at all; a crashed segment never
leaves a half-written state for its retry to resume from. Weights are
replicated over data-parallel ranks, so one copy is enough.

RNG needs no saving: every random draw is seeded from (seed, step, logical
rank), which also makes dropout independent of the physical world size.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

META_FILE = "meta.json"


def state_dir_for(run_dir: Path, segment_index: int) -> Path:
    return run_dir / "state" / f"segment-{segment_index:04d}"


def has_state(state_dir: Path) -> bool:
    return (state_dir / META_FILE).is_file()


def save_training_state(state_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: dict) -> int:
    """Write the state atomically; returns its size in bytes."""
    tmp = state_dir.with_name(state_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / "model.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
    if state_dir.exists():
        shutil.rmtree(state_dir)
    os.replace(tmp, state_dir)
    return sum(p.stat().st_size for p in state_dir.iterdir())


def load_training_state(state_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    if not has_state(state_dir):
        raise FileNotFoundError(f"no complete training state at {state_dir}; rerun the segment that writes it")
    load_model(model, str(state_dir / "model.safetensors"))
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(state_dir / "optimizer.pt", weights_only=True))
    return json.loads((state_dir / META_FILE).read_text())
