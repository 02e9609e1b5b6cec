"""Load a Hugging Face checkpoint straight into FSDP2 shards: each rank reads only its own rows.

Building the whole model on every rank before sharding costs the whole
model's host memory per rank (an 8B FP32 model on 8 ranks: 262 GB). Here:

1. the model is built on the meta device from the checkpoint's config (no
   storage at all), in the training dtype;
2. it is sharded into the same FSDP units as `sharding.shard_model` (the
   same policy: reshard after forward, summed gradients, mixed precision),
   still on meta;
   With `pad_vocab_to_multiple_of`, the vocabulary is padded there, on meta,
   as `build_model` pads it after `from_pretrained`;
3. `to_empty` gives each rank storage for its own shards only (FSDP pads a
   shard to ceil(rows / W) rows; the padding is zero, as `shard_model` makes
   it), and each rank fills its rows from the safetensors files with
   `safe_open(...).get_slice(name)[first:stop]`: about 1/W of the file's
   bytes per rank, cast to the training dtype as `from_pretrained` casts
   (padded vocabulary rows, in no file, are set to zero);
4. non-persistent buffers, which no checkpoint holds (RoPE's `inv_freq`),
   are computed again on the CPU by the module's own constructor, exactly as
   a model built on the CPU computes them (FP32: a bf16 or otherwise wrong
   `inv_freq` changes every logit, silently). A module with non-persistent
   buffers that cannot be rebuilt from the config is refused;
5. FSDP's lazy init runs (a one-token no-grad forward, as in `shard_model`).

`prepare(model)` runs on the meta model before it is sharded: the pipeline
wraps the decoder layers for activation checkpointing there and injects the
LoRA adapter (`lora_injection.inject_lora_on_meta`, which returns the
adapter's initial values, whole: no file holds them; each rank fills its rows
from them). A peft-wrapped base weight (`q_proj.base_layer.weight`) is read
from the file under the model's own name (`q_proj.weight`).

The result is bitwise the model `from_pretrained` then `shard_model` gives:
shards (padding included), buffers and logits.

`shard_model` cannot be called on a meta model (its lazy-init forward would
all-gather meta tensors), so the loader calls `sharding.shard_units`, the same
units without the lazy init, and runs the lazy init once the shards are filled.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from trainer_core.training.vocab import _vocab_parameters, pad_vocabulary

from .shard import ShardedModel, _know_fsdp_params, _lazy_init, shard_units

__all__ = ["LoadReport", "load_sharded"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class LoadReport:
    """What this rank read."""

    bytes_read: int  # tensor bytes read from the files (its rows only)
    file_bytes: int  # tensor bytes the files hold, all of them
    true_vocab: int | None = None  # the true vocabulary when it was padded (pad_vocab_to_multiple_of), else None


def _weight_map(directory: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file (in `directory`) that holds it."""
    index = directory / INDEX_FILE
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = directory / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(f"{directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    with safetensors.safe_open(str(single), framework="pt") as opened:
        return dict.fromkeys(opened.keys(), SINGLE_FILE)


def _rows(tensor: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(first, stop) global dim-0 rows this rank holds of `tensor`, and its local storage for them."""
    if not isinstance(tensor, DTensor):
        return 0, tensor.shape[0] if tensor.dim() else 0, tensor
    if tuple(tensor.placements) != (Shard(0),):
        raise ValueError(f"placements {tensor.placements}: the loader fills dim-0 shards only")
    local_shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return offset[0], offset[0] + local_shape[0], tensor.to_local()


def _stored(name: str) -> str:
    return name.replace(".base_layer.", ".")


def _rounding(model: nn.Module, round_through: torch.dtype | None) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """What a value read for the tensor named `name` passes through before it is cast to the shard's dtype."""
    kept = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())

    def rounded(name: str, value: torch.Tensor) -> torch.Tensor:
        if round_through is None or not value.is_floating_point() or any(k in name for k in kept):
            return value
        return value.to(round_through)

    return rounded


def _fill(
    model: nn.Module,
    directory: Path,
    true_vocab: int | None,
    given: Mapping[str, torch.Tensor],
    rounded: Callable[[str, torch.Tensor], torch.Tensor] = lambda _, value: value,
) -> LoadReport:
    """Copy this rank's rows of every parameter and persistent buffer from the files; returns the bytes read.

    With `true_vocab`, the per-token tensors hold padded rows the files do not have: those are set to zero.
    `given`: whole values of tensors the files do not hold (a LoRA adapter's initial weights), by name.
    """
    padded = {id(p) for p in _vocab_parameters(model)} if true_vocab is not None else set()
    weight_map = _weight_map(directory)
    targets: dict[str, torch.Tensor] = model.state_dict(keep_vars=True)  # tied weights: every name they have
    filled: set[int] = set()
    by_file: dict[str, list[tuple[str, torch.Tensor]]] = {}
    with torch.no_grad():
        for name, value in given.items():
            first, stop, local = _rows(targets[name])
            local.copy_(value[first:stop].to(local.dtype))
            filled.add(id(targets[name]))
    for name, tensor in targets.items():
        if id(tensor) in filled:
            continue
        # peft's wrapper holds a base weight as `.base_layer.`; the file, under the model's own name.
        sources = [stored for n, t in targets.items() if t is tensor and (stored := _stored(n)) in weight_map]
        if not sources:
            raise ValueError(f"{directory}: no tensor named {name} (nor any name tied to it) in the checkpoint")
        filled.add(id(tensor))
        by_file.setdefault(weight_map[sources[0]], []).append((sources[0], tensor))
    read = total = 0
    with torch.no_grad():
        for file in sorted(set(weight_map.values())):
            with safetensors.safe_open(str(directory / file), framework="pt") as opened:
                for stored in opened.keys():
                    part = opened.get_slice(stored)
                    total += _stored_bytes(part)
                for name, tensor in by_file.get(file, []):
                    part = opened.get_slice(name)
                    stored_rows = true_vocab if id(tensor) in padded else None
                    expected = tuple(tensor.shape) if stored_rows is None else (stored_rows, *tensor.shape[1:])
                    if tuple(part.get_shape()) != expected:
                        raise ValueError(
                            f"{file}: tensor {name} has shape {part.get_shape()}, the model {list(tensor.shape)}"
                        )
                    if tensor.dim() == 0:
                        loaded = opened.get_tensor(name)
                        tensor.copy_(rounded(name, loaded).to(tensor.dtype))
                        read += loaded.numel() * loaded.element_size()
                        continue
                    first, stop, local = _rows(tensor)
                    kept = min(stop, stored_rows) if stored_rows is not None else stop
                    if kept > first:
                        loaded = part[first:kept]
                        read += loaded.numel() * loaded.element_size()
                        local[: kept - first].copy_(rounded(name, loaded).to(local.dtype))
                    local[max(kept - first, 0) :].zero_()  # padded vocabulary rows (to_empty left them unset)
    return LoadReport(read, total, true_vocab)


_ELEMENT_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4}
_ELEMENT_BYTES |= {"F32": 4, "F64": 8, "I64": 8, "U64": 8}


def _stored_bytes(part: Any) -> int:
    count = 1
    for size in part.get_shape():
        count *= size
    return count * _ELEMENT_BYTES[part.get_dtype()]


def _rebuild_buffers(model: nn.Module) -> None:
    """Compute every module's non-persistent buffers again on the CPU, as its constructor does (module docstring)."""
    for name, module in model.named_modules():
        transient = getattr(module, "_non_persistent_buffers_set", set())
        if not transient:
            continue
        config = getattr(module, "config", None)
        if config is None:
            raise ValueError(
                f"cannot load {name or 'the model'} ({type(module).__name__}) sharded: its non-persistent buffers "
                f"{sorted(transient)} are in no checkpoint, and it has no config to compute them again from"
            )
        with torch.device("cpu"):
            fresh = type(module)(config=config)
        for buffer in transient:
            old = module._buffers[buffer]
            computed = fresh._buffers[buffer]
            module._buffers[buffer] = None if computed is None or old is None else computed.to(old.device)
        for attribute, value in vars(fresh).items():  # tensors kept beside the buffers (a copy of inv_freq...)
            if isinstance(value, torch.Tensor) and attribute not in ("_buffers", "_parameters"):
                setattr(module, attribute, value)


def _left_on_meta(model: nn.Module) -> list[str]:
    names = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    for module_name, module in model.named_modules():
        names += [f"{module_name}.{a}" for a, v in vars(module).items() if isinstance(v, torch.Tensor) and v.is_meta]
    return names


def load_sharded(
    directory: Path,
    mesh: DeviceMesh,
    *,
    dtype: torch.dtype = torch.float32,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    attn_implementation: str | None = None,
    pad_vocab_to_multiple_of: int | None = None,
    prepare: Callable[[nn.Module], Mapping[str, torch.Tensor]] | None = None,
    round_through: torch.dtype | None = None,
) -> tuple[ShardedModel, LoadReport]:
    """The checkpoint at `directory` (a `from_pretrained` directory) as a sharded model (module docstring).

    Collective: every rank of `mesh` calls it. `dtype`: the parameters' (the masters'); `param_dtype` and
    `reduce_dtype` as in `shard_model`. `pad_vocab_to_multiple_of`: pad the vocabulary rows as
    `vocab.pad_vocabulary` does after `from_pretrained` (zero rows; `LoadReport.true_vocab` says the true size).
    The model is in eval mode, as `from_pretrained` leaves it. `prepare(model)`: what the caller does to the
    meta model before it is sharded (activation checkpointing, LoRA injection), returning the whole values of
    the parameters it added (they are in no file), by state-dict name. `round_through`: every floating value read
    from the files is cast to this dtype before `dtype` (bf16: the masters are what a replica that loaded the
    checkpoint in bf16 holds, its weights upcast), except in the model's `_keep_in_fp32_modules_strict`, which
    `from_pretrained` keeps in FP32.
    """
    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    if (directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(directory), local_files_only=True)
    true_vocab = None
    if pad_vocab_to_multiple_of is not None:
        true_vocab = pad_vocabulary(model, pad_vocab_to_multiple_of)  # on meta: the shapes only; rows filled below
    given = {} if prepare is None else dict(prepare(model))
    units = shard_units(model, mesh, MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
    model.to_empty(device=mesh.device_type)  # this rank's shards only; FSDP zeroes the padding of each
    report = _fill(model, directory, true_vocab, given, _rounding(model, round_through))
    _rebuild_buffers(model)
    left = _left_on_meta(model)
    if left:
        raise ValueError(f"cannot load {directory} sharded: {left[:4]} have no value (neither stored nor rebuilt)")
    model.eval()
    _lazy_init(model)
    _know_fsdp_params(model)
    return ShardedModel(model=model, units=units), report
