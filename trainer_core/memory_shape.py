"""The inputs of the memory model (`trainer_core.memory_model`), read off meta-device models: no memory, no weights.

- `model_shape(model)`: every parameter's rows and numel, grouped into the FSDP
  units `parallel.fsdp.shard.shard_model` makes (the input embedding, each decoder
  layer, [final norm, lm_head], the root with the rest; a tied embedding stays in
  the root). Exact: the shapes are those the run builds.
- `activation_fit(model_config, dtype)`: saved bytes per token of a decoder
  layer and of the rest of the model, from the bytes a forward saves for
  backward (`saved_tensors_hooks`, parameters excluded) on the meta device, at 1
  and 2 layers and two lengths: `layer = a·T + c·T²` per row. On the meta device
  `scaled_dot_product_attention` takes the math path, which saves the attention
  probabilities (T²) where the fused kernels of a GPU (and a CPU) save only
  q, k, v, the output and the log-sum-exp; the measurement stands that fused
  kernel in for it (the same saved tensors, shapes only), so the fit is the
  real run's. Eager attention is measured as it is.

torch and transformers are imported here: callers (`run.validate`, the bench)
import this module only where they already build meta-device models.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

from .memory_model import DTYPE_BYTES, ActivationFit, ModelShape, ParamShape, Unit

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["activation_fit", "meta_model", "model_shape", "saved_bytes"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_LENGTHS = (64, 128)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    # The rule of parallel.fsdp.shard.decoder_layers, without importing FSDP.
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers, inside = [], []
    for name, module in model.named_modules():
        if type(module).__name__ in names and not any(name.startswith(prefix + ".") for prefix in inside):
            layers.append(module)
            inside.append(name)
    if not layers:
        fallback = getattr(getattr(model, "model", None), "layers", None)
        layers = list(fallback) if isinstance(fallback, nn.ModuleList) else []
    return layers


def _accessor(model: nn.Module, method: str) -> nn.Module | None:
    getter = getattr(model, method, None)
    found = getter() if callable(getter) else None
    return found if isinstance(found, nn.Module) else None


def _unit_modules(model: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """The non-root units in forward order, as shard_model groups them."""
    embed, head = _accessor(model, "get_input_embeddings"), _accessor(model, "get_output_embeddings")
    if (
        embed is not None
        and head is not None
        and {id(p) for p in embed.parameters()} & {id(p) for p in head.parameters()}
    ):
        embed, head = None, None  # tied: both stay in the root
    decoder = _accessor(model, "get_decoder") or getattr(model, "model", None)
    norm = getattr(decoder, "norm", None)
    units: list[tuple[str, list[nn.Module]]] = []
    if embed is not None:
        units.append(("embedding", [embed]))
    units += [(f"layer {i}", [layer]) for i, layer in enumerate(_decoder_layers(model))]
    tail = [m for m in (norm if isinstance(norm, nn.Module) else None, head) if m is not None]
    if tail:
        units.append(("norm + lm_head", tail))
    return units


def model_shape(model: nn.Module, *, trainable: Callable[[str], bool] | None = None) -> ModelShape:
    """The shape of `model` (any device; meta costs nothing), grouped into FSDP units.

    `trainable(name)` says which parameters train (default: those with requires_grad): with LoRA, the adapters.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    is_trainable = trainable or (lambda name: dict(model.named_parameters())[name].requires_grad)
    claimed: set[int] = set()

    def shapes(params: Iterator[nn.Parameter]) -> tuple[ParamShape, ...]:
        found = []
        for p in params:
            if id(p) in claimed:
                continue
            claimed.add(id(p))
            rows = p.shape[0] if p.dim() else 1
            found.append(ParamShape(rows=int(rows), numel=p.numel(), trainable=is_trainable(names[id(p)])))
        return tuple(found)

    units = [Unit(name, shapes(p for m in modules for p in m.parameters())) for name, modules in _unit_modules(model)]
    root = Unit("root", shapes(model.parameters()))
    head = _accessor(model, "get_output_embeddings")
    weight = getattr(head, "weight", None)
    vocab_rows = int(weight.shape[0]) if isinstance(weight, torch.Tensor) else 0
    return ModelShape(
        units=tuple(u for u in (*units, root) if u.params),
        num_layers=len(_decoder_layers(model)),
        vocab_rows=vocab_rows,
    )


def meta_model(model_config: PretrainedConfig, dtype: str, *, num_layers: int | None = None) -> nn.Module:
    """The model of `model_config` on the meta device in `dtype` (optionally cut to `num_layers` decoder layers)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model_config)
    if num_layers is not None:
        config.num_hidden_layers = num_layers
        if isinstance(getattr(config, "layer_types", None), list):  # one entry per layer (Qwen3: attention kinds)
            config.layer_types = config.layer_types[:num_layers]
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])


class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel saves for backward (q, k, v, output, FP32 log-sum-exp); shapes only."""

    @staticmethod
    def forward(ctx, q, k, v):  # pyright: ignore[reportIncompatibleMethodOverride]
        # Fused kernels write the output token-major ([B, T, H, D]) and return it transposed, so the usual
        # `.transpose(1, 2).contiguous()` after attention is a view of the saved output, not a second tensor.
        batch, heads, length = q.shape[:-1]
        out = q.new_empty((batch, length, heads, v.shape[-1])).transpose(1, 2)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, *grads):  # pyright: ignore[reportIncompatibleMethodOverride]
        raise RuntimeError("a shape-only attention cannot be differentiated")


@contextmanager
def _fused_attention_on_meta() -> Iterator[None]:
    original = F.scaled_dot_product_attention

    def attention(q, k, v, *args, **kwargs):
        if q.device.type != "meta":
            return original(q, k, v, *args, **kwargs)
        return _FusedAttention.apply(q, k, v)

    with mock.patch.object(F, "scaled_dot_product_attention", attention):
        yield


def saved_bytes(model: nn.Module, input_ids: torch.Tensor, **kwargs) -> int:
    """Bytes a forward of `model` saves for backward: distinct storages, parameters excluded."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in params:
            seen[storage._cdata] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=input_ids, **kwargs)
    return sum(seen.values())


def activation_fit(model_config: PretrainedConfig, dtype: str) -> ActivationFit:
    """Saved bytes per token of one decoder layer (a·T + c·T²) and of the rest, measured on the meta device."""
    measured = {}
    with _fused_attention_on_meta():
        for layers in (1, 2):
            model = meta_model(model_config, dtype, num_layers=layers)
            model.train()
            for t in _LENGTHS:
                ids = torch.zeros((1, t), dtype=torch.long, device="meta")
                # use_cache=True: without it transformers reads the meta position ids' values (see model_checks).
                measured[layers, t] = saved_bytes(model, ids, use_cache=True)
    (t1, t2) = _LENGTHS
    per_layer = {t: measured[2, t] - measured[1, t] for t in _LENGTHS}
    # layer(T) = a·T + c·T², solved from the two lengths.
    quadratic = max(0.0, (per_layer[t2] / t2 - per_layer[t1] / t1) / (t2 - t1))
    linear = per_layer[t1] / t1 - quadratic * t1
    rest = max((measured[1, t] - per_layer[t]) / t for t in _LENGTHS)
    hidden = int(model_config.hidden_size)
    return ActivationFit(
        layer_linear=linear,
        layer_quadratic=quadratic,
        rest_linear=rest,
        # A checkpointed layer keeps its input hidden states; the rotary tables and masks it also gets are the
        # same tensors for every layer, counted once in `rest`.
        checkpointed_layer_linear=float(hidden * DTYPE_BYTES[dtype]),
    )
