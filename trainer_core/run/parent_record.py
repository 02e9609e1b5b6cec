"""The record beside a committed checkpoint a run starts from (`PARENT_FILE`): where it came from.

`infra/publication/parent.py` writes it into the fetched copy of the checkpoint `model.path` names (a full
model's directory, or a LoRA checkpoint whose adapter continues: `model.lora.init_from`). The plan's input
fingerprint takes the manifest's sha256 from it, the ledger's plan line names it, and the export ships a continued
adapter's base again (its base lives only in this run's cache). Nothing here imports more than the standard library.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer_core.config import RunConfig

PARENT_FILE = ".rankflow-parent.json"
"""Beside a committed checkpoint fetched as `model.path` (infra/publication/parent.py): where it came from."""


def parent_of(model_dir: str | None) -> dict | None:
    """The committed checkpoint a fetched directory came from (url, run_id, checkpoint, manifest_sha256)."""
    if model_dir is None or not (Path(model_dir) / PARENT_FILE).is_file():
        return None
    return json.loads((Path(model_dir) / PARENT_FILE).read_text())


def run_parent(config: RunConfig) -> dict | None:
    """The committed checkpoint the run starts from: a full model's (`model.path`), or a LoRA adapter's that
    continues (`model.lora.init_from`, with `model.path` its base)."""
    lora = config.model.lora
    return parent_of(config.model.path) or (parent_of(lora.init_from) if lora is not None else None)
