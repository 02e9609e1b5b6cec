"""The model's weights as a plain Hugging Face checkpoint: peft's wrappers unwrapped, adapters dropped or merged, vocab cut.

A trainer's model may carry peft LoRA layers (`q_proj` → `q_proj.base_layer`
plus `lora_A` / `lora_B`) and a padded vocabulary. `hf_state_dict` gives the
weights under the names `AutoModelForCausalLM` expects: `.base_layer` folded
away, adapter tensors (peft names them `lora_*`) left out — or, for
`merge_adapter=NAME`, each wrapped layer's base weights (and bias) replaced by
what peft's own `merge` makes of them — and the per-token rows cut to the true
vocabulary. `save_hf_model` writes it with `save_pretrained`, the config
saying the true vocabulary size.

The merge is peft's, layer by layer, on a private float32 copy of the layer
(each merged tensor is rounded once, to the dtype it trained in): a
variant changes what merging means (DoRA rescales every output row by its
trained magnitude, `lora_bias` moves the base bias, rsLoRA scales by
α/√r), and `W + get_delta_weight` is right for plain LoRA only. The live
model is never touched (merging in place and unmerging after would change
the training weights by rounding). A variant peft cannot merge (aLoRA, an
Arrow router…) is refused with its reason, before anything is written.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from .vocab import cut_to_true_vocab, true_vocab_config, vocab_parameter_names

_BASE_LAYER = ".base_layer"


def _merged_layer(module: nn.Module, module_name: str, adapter: str) -> dict[str, torch.Tensor]:
    """The base layer's tensors after peft merges `adapter` into a copy of the layer: `{module_name}.base_layer.*`."""
    copied = copy.deepcopy(module)  # one layer at a time: the copy costs one layer's weights, briefly
    # The layer is a peft LoraLayer, which peft types as a mixin, not an nn.Module: pyright reads its methods
    # through torch's nn.Module.__getattr__ (typed Tensor | Module), hence the ignores on their calls.
    unmerged = copied.get_base_layer()  # pyright: ignore[reportCallIssue]
    dtypes = {name: tensor.dtype for name, tensor in unmerged.state_dict().items()}
    # Merged in float32 and rounded once to each tensor's own dtype: in bf16, peft would round ΔW before adding it.
    copied.float()
    try:
        # safe_merge: peft checks the merged weights are finite (a broken adapter raises, naming itself).
        copied.merge(safe_merge=True, adapter_names=[adapter])  # pyright: ignore[reportCallIssue]
    except (NotImplementedError, RuntimeError) as refused:
        raise ValueError(
            f"adapter '{adapter}' cannot be merged into the base weights ({module_name}: {refused}); "
            "export it unmerged (export.merge_lora = false / no merge_adapter) and load it with "
            "PeftModel.from_pretrained"
        ) from None
    base = copied.get_base_layer()  # pyright: ignore[reportCallIssue]
    return {f"{module_name}{_BASE_LAYER}.{name}": tensor.to(dtypes[name]) for name, tensor in base.state_dict().items()}


def _merged_base_tensors(model: nn.Module, adapter: str) -> dict[str, torch.Tensor]:
    """Every peft layer's base tensors with `adapter` merged, by their names in `model.state_dict()`."""
    from peft.tuners.lora import LoraLayer

    merged: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if isinstance(module, LoraLayer) and adapter in module.lora_A.keys() | module.lora_embedding_A.keys():
                # peft's LoraLayer is a mixin its stubs do not make an nn.Module; the layers here are both.
                merged.update(_merged_layer(module, module_name, adapter))  # pyright: ignore[reportArgumentType]
    if not merged:
        raise ValueError(f"no LoRA layer holds an adapter named '{adapter}'; nothing to merge")
    unplaced = sorted(merged.keys() - model.state_dict().keys())
    # A layer whose merged tensors are not the model's own (a peft layer wrapping a bare parameter) must not be
    # left out silently: the export would hold the unmerged weights.
    assert not unplaced, f"merged tensors with no place in the model's weights: {unplaced[:4]}"
    return merged


def hf_state_dict(
    model: nn.Module, *, vocab_size: int | None = None, merge_adapter: str | None = None
) -> dict[str, torch.Tensor]:
    """Plain Hugging Face weights of `model` (see the module docstring)."""
    state: dict[str, torch.Tensor] = model.state_dict()
    merged = _merged_base_tensors(model, merge_adapter) if merge_adapter is not None else {}
    plain: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        exported = hf_name(name)
        if exported is not None:
            plain[exported] = merged.get(name, tensor).detach()
    if vocab_size is not None:
        plain = cut_to_true_vocab(plain, hf_vocab_names(model), vocab_size)
    return plain


def hf_name(name: str) -> str | None:
    """The Hugging Face name of the model's state-dict entry `name`; None for an adapter tensor (left out)."""
    if ".lora_" in name:
        return None
    return name.replace(_BASE_LAYER, "")


def hf_vocab_names(model: nn.Module) -> set[str]:
    """Hugging Face names of the per-token tensors, the ones cut to the true vocabulary on export."""
    return {name.replace(_BASE_LAYER, "") for name in vocab_parameter_names(model)}


def save_hf_model(
    model: nn.Module,
    directory: Path,
    *,
    vocab_size: int | None = None,
    merge_adapter: str | None = None,
    max_shard_size: str = "2GB",
) -> None:
    """Write `model` as a Hugging Face directory that `AutoModelForCausalLM.from_pretrained` loads."""
    state = hf_state_dict(model, vocab_size=vocab_size, merge_adapter=merge_adapter)
    # `model` is a transformers model: torch's stubs type its methods, read through nn.Module.__getattr__,
    # as Tensor | Module, hence the ignores.
    true_size = vocab_size
    if true_size is None:
        true_size = model.get_input_embeddings().weight.shape[0]  # pyright: ignore[reportCallIssue]
    with true_vocab_config(model, true_size):
        model.save_pretrained(  # pyright: ignore[reportCallIssue]
            str(directory), state_dict=state, max_shard_size=max_shard_size
        )
