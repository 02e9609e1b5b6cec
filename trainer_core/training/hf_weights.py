"""The model's weights as a plain Hugging Face checkpoint: peft's wrappers unwrapped, adapters dropped or merged, vocab cut.

A trainer's model may carry peft LoRA layers (`q_proj` → `q_proj.base_layer`
plus `lora_A` / `lora_B`) and a padded vocabulary. `hf_state_dict` gives the
weights under the names `AutoModelForCausalLM` expects: `.base_layer` folded
away, adapter tensors (peft names them `lora_*`) left out — or, for
`merge_adapter=NAME`, each wrapped weight replaced by `W + ΔW` with peft's own
`get_delta_weight` (computed in float32, stored in the weight's dtype) — and
the per-token rows cut to the true vocabulary. `save_hf_model` writes it with
`save_pretrained`, the config saying the true vocabulary size.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .vocab import cut_to_true_vocab, true_vocab_config, vocab_parameter_names

_BASE_LAYER = ".base_layer"


def _merged_deltas(model: nn.Module, adapter: str) -> dict[str, torch.Tensor]:
    """`{module_name}.base_layer.weight` → ΔW of `adapter`, for every peft layer that holds the adapter."""
    from peft.tuners.lora import LoraLayer

    deltas = {}
    for module_name, module in model.named_modules():
        if isinstance(module, LoraLayer) and adapter in module.lora_A:
            deltas[f"{module_name}{_BASE_LAYER}.weight"] = module.get_delta_weight(adapter)
    if not deltas:
        raise ValueError(f"no LoRA layer holds an adapter named '{adapter}'; nothing to merge")
    return deltas


def hf_state_dict(model: nn.Module, *, vocab_size: int | None = None, merge_adapter: str | None = None) -> dict[str, torch.Tensor]:
    """Plain Hugging Face weights of `model` (see the module docstring)."""
    state = model.state_dict()
    deltas = _merged_deltas(model, merge_adapter) if merge_adapter is not None else {}
    plain: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in state.items():
            if ".lora_" in name:
                continue
            if name in deltas:
                tensor = (tensor.float() + deltas[name].float()).to(tensor.dtype)
            plain[name.replace(_BASE_LAYER, "")] = tensor.detach()
    if vocab_size is not None:
        names = {name.replace(_BASE_LAYER, "") for name in vocab_parameter_names(model)}
        plain = cut_to_true_vocab(plain, names, vocab_size)
    return plain


def save_hf_model(model: nn.Module, directory: Path, *, vocab_size: int | None = None, merge_adapter: str | None = None,
                  max_shard_size: str = "2GB") -> None:
    """Write `model` as a Hugging Face directory that `AutoModelForCausalLM.from_pretrained` loads."""
    state = hf_state_dict(model, vocab_size=vocab_size, merge_adapter=merge_adapter)
    true_size = vocab_size if vocab_size is not None else model.get_input_embeddings().weight.shape[0]
    with true_vocab_config(model, true_size):
        model.save_pretrained(str(directory), state_dict=state, max_shard_size=max_shard_size)
