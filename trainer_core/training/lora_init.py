"""Start a LoRA adapter from saved weights: a committed adapter continues (`model.lora.init_from`).

A committed LoRA checkpoint holds peft's files (`adapter_config.json`, `adapter_model.safetensors`, written by
`checkpoint_io.export_checkpoint_module` with `get_peft_model_state_dict`) and its base model under `base/`. peft
saves each adapter tensor under the wrapper's name without the adapter's name
(`base_model.model.M.lora_A.weight`); the trainer's model holds it as `M.lora_A.NAME.weight` (`lora_embedding_A`:
`M.lora_embedding_A.NAME`). `adapter_values` maps one onto the other and refuses anything that does not match
exactly (a tensor missing, one left over, another shape), so an adapter of another rank or other modules never
loads silently. `adapter_settings` reads what `[model.lora]` must agree with.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."


_WRAPPER = "._checkpoint_wrapped_module"  # activation checkpointing's wrapper: not in the saved names


def _saved_name(param_name: str, adapter: str) -> str | None:
    """The name peft saves `param_name` (a parameter of adapter `adapter`) under; None for another parameter."""
    param_name = param_name.replace(_WRAPPER, "")
    if f".{adapter}." in param_name:
        return _PEFT_PREFIX + param_name.replace(f".{adapter}.", ".", 1)
    if param_name.endswith(f".{adapter}"):
        return _PEFT_PREFIX + param_name.removesuffix(f".{adapter}")
    return None


def adapter_values(directory: Path, adapter: str, expected: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """The saved adapter's tensors under the model's parameter names (`expected`: name → shape, every parameter of
    adapter `adapter`); a ValueError names what does not match."""
    saved = load_file(str(directory / ADAPTER_WEIGHTS))
    values: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    for name, shape in expected.items():
        key = _saved_name(name, adapter)
        if key is None or key not in saved:
            missing.append(name)
            continue
        if saved[key].shape != shape:
            raise ValueError(
                f"{directory / ADAPTER_WEIGHTS}: {key} has shape {tuple(saved[key].shape)}, the adapter being "
                f"trained has {tuple(shape)} (another rank or base model)"
            )
        values[name] = saved[key]
    extra = sorted(set(saved) - {_saved_name(name, adapter) for name in expected})
    if missing or extra:
        raise ValueError(
            f"{directory / ADAPTER_WEIGHTS} does not hold the adapter being trained: "
            f"{len(missing)} tensor(s) missing (e.g. {missing[:2]}), {len(extra)} not in it (e.g. {extra[:2]}); "
            "its target modules differ"
        )
    return values


def adapter_settings(directory: Path) -> dict:
    """rank, alpha, dropout and target_modules of a saved peft adapter, as `[model.lora]` names them."""
    raw = json.loads((directory / ADAPTER_CONFIG).read_text())
    targets = raw.get("target_modules")
    return {
        "rank": int(raw["r"]),
        "alpha": float(raw["lora_alpha"]),
        "dropout": float(raw.get("lora_dropout") or 0.0),
        "target_modules": targets if isinstance(targets, str) else sorted(targets),
    }
