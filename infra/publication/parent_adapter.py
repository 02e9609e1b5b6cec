"""`model.path` naming a committed LoRA checkpoint: its adapter continues training on its base.

A LoRA run commits peft's adapter files and, under `base/`, the base model it was trained on
(`trainer_core/run/checkpoint_layout.py`), all pinned by the checkpoint's manifest and fetched verified
(`parent.fetch_checkpoint`). Continuing it means: `model.path` becomes that `base/`, `[model.lora]` takes the
adapter's rank, alpha and target modules (written in the config, or checked against it: another rank or alpha
would be another adapter, refused with exit 2; other modules are refused when the adapter loads), and `model.lora.init_from` names the fetched
adapter, whose weights the trainer starts from (`trainer_core.training.lora_init`), with a fresh optimizer and
the run's own schedule. The adapter's bytes and the checkpoint's manifest join the run id
(`validate.input_fingerprint`), and the ledger's plan line names the parent checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from trainer_core.config import LoraSection, RunConfig
from trainer_core.errors import ConfigError
from trainer_core.training.lora_init import adapter_settings

_MUST_AGREE = ("rank", "alpha")
"""Compared here; the target modules are compared tensor by tensor when the adapter loads (`lora_init`): peft saves
them as full module paths, which "all-linear" or suffixes in [model.lora] name only once the model is built."""


def continue_adapter(config: RunConfig, checkpoint_dir: Path, label: str) -> None:
    """Point `config` at the fetched LoRA checkpoint's base and adapter (see the module docstring)."""
    if not (checkpoint_dir / "base" / "config.json").is_file():
        raise ConfigError(
            f"{label} is a LoRA adapter checkpoint without its base model (no base/config.json); set model.path "
            "to the base model it was trained on and model.lora.init_from to the adapter's directory"
        )
    if config.train.shards_weights:
        raise ConfigError(
            f"{label} is a LoRA adapter checkpoint, and continuing an adapter with train.sharding = "
            f'"{config.train.sharding}" is not supported yet; set train.sharding = "none" to continue it'
        )
    saved = adapter_settings(checkpoint_dir)
    if config.model.lora is None:
        config.model.lora = LoraSection.model_validate(saved)
    else:
        given = config.model.lora.model_dump()
        differ = [
            f"{key} {given[key]!r} (the adapter's: {saved[key]!r})" for key in _MUST_AGREE if given[key] != saved[key]
        ]
        if differ:
            raise ConfigError(
                f"{label} is a LoRA adapter of other settings than [model.lora]: {'; '.join(differ)}; remove "
                "[model.lora] (it is read from the adapter) or set those keys to the adapter's"
            )
    config.model.lora.init_from = str(checkpoint_dir)
    config.model.path = str(checkpoint_dir / "base")
