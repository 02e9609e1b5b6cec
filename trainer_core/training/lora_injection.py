"""Inject a peft LoRA adapter into a model: for `add_lora_checkpoint`, and before `shard_model` for a sharded one.

Sharding turns the parameters a unit holds into distributed tensors when it
is applied; peft injecting later would put plain parameters inside the
engine's units, which it never gathers or reduces. So a sharded model's adapters are
injected first, with `inject_lora` (each adapter's parameters then become
dim-0 shards inside their decoder layer's unit), and the sharded trainer's
`add_lora_checkpoint` adopts the injected adapter by name.

`inject_lora` draws the initial weights exactly as the unsharded
`add_lora_checkpoint` does (peft's own initialisation, from the global RNG,
in the same order adapter by adapter), so at the same RNG state the adapters
are bitwise the unsharded ones. A sharded bf16 model's parameters are FP32
when the adapter is injected (its shards are the masters) while the unsharded
bf16 run builds the adapter in bf16, where peft casts the FP32 initialisation
to bf16 and the trainer's FP32 master is that bf16 value: `round_to=torch.bfloat16` rounds the new adapter
through bf16 so the masters start from the same bits.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection

import torch
from torch import nn

from ..parallel import is_distributed

__all__ = ["adapter_parameters", "inject_lora", "inject_lora_on_meta"]

WRAPPED = "_checkpoint_wrapped_module."  # activation checkpointing's wrapper, absent from state dict names


def adapter_parameters(model: nn.Module, name: str) -> list[tuple[str, nn.Parameter]]:
    """The parameters of peft adapter `name` in `model` (`...lora_A.<name>.weight` and its kin), in model order."""
    found = []
    for qualified, param in model.named_parameters():
        parts = qualified.split(".")
        if any(part.startswith("lora_") and after == name for part, after in zip(parts, parts[1:])):
            found.append((qualified, param))
    return found


def inject(model: nn.Module, name: str, lora_config, keep: Collection[int] = ()) -> list[tuple[str, nn.Parameter]]:
    """peft's `inject_adapter_in_model` with every parameter but those in `keep` (ids) frozen first; the new ones."""
    from peft import inject_adapter_in_model

    before = {id(p) for p in model.parameters()}
    for param in model.parameters():
        if id(param) not in keep:
            param.requires_grad_(False)
    with warnings.catch_warnings():
        # A second adapter: peft warns that the model holds several; that is what the slots are for.
        warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
        inject_adapter_in_model(lora_config, model, adapter_name=name)
    return [(n, p) for n, p in model.named_parameters() if id(p) not in before]


def inject_lora(model: nn.Module, name: str, lora_config, *, round_to: torch.dtype | None = None) -> None:
    """Inject adapter `name` into a model about to be sharded; the base stays frozen, every adapter trainable.

    Call it once per adapter, in the order the unsharded run registers them, then `shard_model`, then
    `trainer.add_lora_checkpoint(name, lora_config)` for each. `round_to`: the dtype the unsharded run builds
    the model in, when it is lower than the FP32 the sharded model is built in (see the module docstring).
    """
    if name in getattr(model, "peft_config", {}):
        raise ValueError(f"the model already holds a LoRA adapter named '{name}'; choose another name")
    if any(is_distributed(param) for param in model.parameters()):
        # Checked before peft touches it: an adapter injected now would sit unsharded inside the sharded units.
        raise ValueError(
            f"cannot inject LoRA adapter '{name}' into a model that is already sharded: inject every adapter "
            "before shard_model"
        )
    injected = {id(p) for n, p in _every_adapter(model)}
    new = inject(model, name, lora_config, keep=injected)
    if round_to is not None:
        with torch.no_grad():
            for _, param in new:
                param.copy_(param.to(round_to))
    # peft leaves only the newest adapter trainable; each one trains once registered, as the unsharded slots do
    # (the sharded engine's lazy init in shard_model then sets every adapter up as a trained parameter).
    for _, param in _every_adapter(model):
        param.requires_grad_(True)


def _every_adapter(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [pair for adapter in getattr(model, "peft_config", {}) for pair in adapter_parameters(model, adapter)]


def inject_lora_on_meta(
    model: nn.Module, name: str, lora_config, *, round_to: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """`inject_lora` into a meta-device model (`fsdp.load`); returns the adapter's initial values, whole, on CPU.

    peft creates and initialises the adapter's layers on the CPU, drawing from the global RNG as it does for a
    CPU model, then moves them to the base layer's device: on meta, the values would be lost. They are kept
    here, by parameter name (activation checkpointing's wrapper name folded away, as in the model's state
    dict), for the loader to fill each rank's rows with: bitwise the unsharded run's initial adapter.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    kept: dict[int, dict[str, torch.Tensor]] = {}
    move = BaseTunerLayer._move_adapter_to_device_of_base_layer

    def keep_then_move(layer: BaseTunerLayer, adapter_name: str, device: torch.device | None = None) -> None:
        for attribute in (*layer.adapter_layer_names, *layer.other_param_names):
            held = getattr(layer, attribute, None)
            if isinstance(held, nn.ModuleDict) and adapter_name in held:
                for param_name, param in held[adapter_name].named_parameters():
                    if not param.is_meta:
                        key = f"{attribute}.{adapter_name}.{param_name}"
                        kept.setdefault(id(layer), {})[key] = param.detach().clone()
            elif isinstance(held, nn.ParameterDict) and adapter_name in held and not held[adapter_name].is_meta:
                kept.setdefault(id(layer), {})[f"{attribute}.{adapter_name}"] = held[adapter_name].detach().clone()
        move(layer, adapter_name, device)

    BaseTunerLayer._move_adapter_to_device_of_base_layer = keep_then_move  # pyright: ignore[reportAttributeAccessIssue]
    try:
        inject_lora(model, name, lora_config)
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer = move
    values = {}
    for module_name, module in model.named_modules():
        for key, value in kept.get(id(module), {}).items():
            qualified = f"{module_name}.{key}".replace(WRAPPED, "")
            values[qualified] = value if round_to is None else value.to(round_to).to(value.dtype)
    return values
