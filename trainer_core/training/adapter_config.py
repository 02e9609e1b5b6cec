"""Write a LoRA adapter's `adapter_config.json`: peft's file, with the same bytes in every process.

peft keeps `target_modules` (and `exclude_modules`) as a set and writes it as `list(set)`, in the order of the
process's string hash seed: two bitwise-equal runs published different files, and so different manifests. Every
set-valued field is written here as a sorted list; peft reads a list back into the same set.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .lora_init import ADAPTER_CONFIG

__all__ = ["save_adapter_config"]


def save_adapter_config(adapter_config: Any, directory: Path) -> Path:
    """Write peft config `adapter_config` (a `PeftConfig`) into `directory` as peft does, every set as a sorted list.

    Returns the file written. peft writes first (its keys, its order, any field a newer peft adds); the sets are
    then put in order in that file's own layout (`json.dumps(..., indent=2)`, as peft writes it).
    """
    adapter_config.save_pretrained(str(directory))
    path = directory / ADAPTER_CONFIG
    written = json.loads(path.read_text(encoding="utf-8"))
    for key, value in adapter_config.to_dict().items():
        if isinstance(value, (set, frozenset)) and key in written:
            written[key] = sorted(value)
    path.write_text(json.dumps(written, indent=2), encoding="utf-8")
    return path
