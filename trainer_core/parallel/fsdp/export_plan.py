"""The files `hf_weights.save_hf_model` would write for a sharded model, planned from its global shapes alone.

No tensor is gathered: every rank computes the same plan. It names each
tensor as `save_hf_model` does (peft's `.base_layer` folded away, adapters
left out, per-token rows cut to the true vocabulary, tied weights written
once by transformers' own rule, `merge_adapter`'s layers marked), splits them
into files as huggingface_hub splits them (over the storage sizes the
unsharded tensors report, in the export dtype), and lays out each file's
header as safetensors does (tensors by descending dtype, then name; compact
JSON with the metadata first; padded with spaces to 8 bytes; an 8-byte
little-endian length in front). Writing each tensor's bytes at its planned
offset therefore gives the unsharded export's files byte for byte
(`fsdp.export.py` writes them, `tests/trainer/test_sharded_export.py`
compares them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from torch import nn
from torch.distributed.fsdp import fully_shard
from transformers.modeling_utils import remove_tied_weights_from_state_dict

from trainer_core.training.hf_weights import hf_name, hf_vocab_names

from .shard import ShardedModel

__all__ = ["DTYPE_CODES", "INDEX_FILE", "Entry", "ExportOptions", "ExportPlan", "export_dtype", "plan_export"]

WEIGHTS_PATTERN = "model{suffix}.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_METADATA = {"format": "pt"}  # what save_pretrained writes into every safetensors header

# safetensors' dtype codes, in the order of its Rust `Dtype` enum: a file lists its tensors by descending dtype.
DTYPE_CODES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
}
_DTYPE_RANK = {code: rank for rank, code in enumerate(DTYPE_CODES.values())}


@dataclass(frozen=True)
class Entry:
    """One tensor of the export: where it comes from, and where its bytes go."""

    name: str  # its Hugging Face name
    source: torch.Tensor  # the model's parameter or buffer (a DTensor when sharded)
    rows: int | None  # rows kept of a padded per-token tensor (the true vocabulary), else None
    dtype: torch.dtype  # the export dtype
    file: str
    begin: int  # absolute byte offsets in the file
    end: int
    merge: tuple[str, nn.Module] | None = None  # (name, peft layer) whose merge gives this tensor's value

    @property
    def shape(self) -> tuple[int, ...]:
        full = tuple(self.source.shape)
        return full if self.rows is None else (self.rows, *full[1:])


@dataclass(frozen=True)
class ExportPlan:
    entries: tuple[Entry, ...]  # in write order: unit by unit, then what no unit holds
    units: tuple[tuple[Entry, ...], ...]  # the entries of each unit (the last: tensors outside every unit)
    headers: dict[str, bytes]  # file name -> its first bytes (length prefix + JSON header)
    sizes: dict[str, int]  # file name -> its total size
    index: dict[str, Any] | None  # model.safetensors.index.json, when the export spans several files


def _unit_params(sharded: ShardedModel) -> list[list[torch.Tensor]]:
    """The sharded parameters of each FSDP unit, in unit order."""
    found = []
    for unit in sharded.units:
        state = fully_shard.state(unit)  # pyright: ignore[reportArgumentType]  # an FSDPModule is an nn.Module
        found.append([fp.sharded_param for group in state._fsdp_param_groups for fp in group.fsdp_params])
    return found


def _header(entries: list[tuple[str, torch.dtype, tuple[int, ...], int]]) -> tuple[bytes, list[int]]:
    """A safetensors header for (name, dtype, shape, nbytes) tensors, and each one's data offset, in `entries` order.

    As safetensors writes it: tensors laid out by descending dtype, then name; compact JSON with the metadata
    first; padded with spaces to a multiple of 8 bytes; an 8-byte little-endian length in front.
    """
    order = sorted(range(len(entries)), key=lambda i: (-_DTYPE_RANK[DTYPE_CODES[entries[i][1]]], entries[i][0]))
    header: dict[str, Any] = {"__metadata__": _METADATA}
    offsets = [0] * len(entries)
    offset = 0
    for i in order:
        name, dtype, shape, nbytes = entries[i]
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offsets[i] = offset
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, offsets


def _merging(model: nn.Module, adapter: str | None) -> dict[str, tuple[str, nn.Module]]:
    """State-dict name of each base tensor that merging `adapter` replaces -> (its peft layer's name, the layer)."""
    if adapter is None:
        return {}
    from peft.tuners.lora import LoraLayer

    found: dict[str, tuple[str, nn.Module]] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, LoraLayer) and adapter in module.lora_A.keys() | module.lora_embedding_A.keys():
            base = module.get_base_layer()
            for leaf in base.state_dict(keep_vars=True):
                found[f"{module_name}.base_layer.{leaf}"] = (module_name, module)  # pyright: ignore[reportArgumentType]
    if not found:
        raise ValueError(f"no LoRA layer holds an adapter named '{adapter}'; nothing to merge")
    return found


class ExportOptions(TypedDict, total=False):
    """How a sharded model is exported: the same for its plan, its write and its verify."""

    vocab_size: int | None
    """The true vocabulary of a padded one (its per-token rows are cut to it); None: not padded."""
    dtype: torch.dtype | None
    """The export dtype of floating-point tensors; None: their own."""
    max_shard_size: int | str
    """Split the weights into files past this size, as `save_pretrained` does (default "2GB")."""
    merge_adapter: str | None
    """The LoRA adapter to merge into the base weights (the `merged/` export); None: none."""


def export_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype `tensor` is exported in: `dtype` for a floating-point one, else its own."""
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def plan_export(sharded: ShardedModel, **options: Unpack[ExportOptions]) -> ExportPlan:
    """The files `save_hf_model` would write for `sharded`'s weights, from their global shapes (no collective)."""
    vocab_size, dtype = options.get("vocab_size"), options.get("dtype")
    merge_adapter = options.get("merge_adapter")
    model = sharded.model
    state: dict[str, torch.Tensor] = model.state_dict(keep_vars=True)  # the parameters themselves: no gather
    vocab_names = hf_vocab_names(model) if vocab_size is not None else set()
    merging = _merging(model, merge_adapter)
    chosen: dict[str, tuple[torch.Tensor, int | None, torch.dtype]] = {}
    merges: dict[str, tuple[str, nn.Module]] = {}
    for name, tensor in state.items():
        exported = hf_name(name)
        if exported is None:
            continue
        rows = vocab_size if exported in vocab_names and tensor.shape[0] > vocab_size else None  # type: ignore[operator]
        cast = export_dtype(tensor, dtype)
        chosen[exported] = (tensor, rows, cast)
        if name in merging:
            merges[exported] = merging[name]
    for ignored in getattr(model, "_keys_to_ignore_on_save", None) or ():
        chosen.pop(ignored, None)

    # Tied weights: transformers keeps one name per storage. One 1-element storage per distinct parameter makes its
    # rule see exactly which names share a tensor.
    storages: dict[int, torch.Tensor] = {}
    stand_ins = {
        name: storages.setdefault(id(tensor), torch.zeros(1, dtype=cast)).expand(tensor.shape)
        for name, (tensor, _, cast) in chosen.items()
    }
    kept = remove_tied_weights_from_state_dict(stand_ins, model)  # pyright: ignore[reportArgumentType]
    chosen = {name: chosen[name] for name in kept}

    # The split: huggingface_hub's, over what save_hf_model's tensors would report (a cut tensor is a view: its
    # storage is still the padded parameter's), in the export dtype. Meta tensors give those sizes for free.
    sized = {}
    for name, (tensor, rows, cast) in chosen.items():
        whole = torch.empty(tuple(tensor.shape), dtype=cast, device="meta")
        sized[name] = whole if rows is None else whole[:rows]
    split = split_torch_state_dict_into_shards(
        sized, filename_pattern=WEIGHTS_PATTERN, max_shard_size=options.get("max_shard_size", "2GB")
    )

    placed: dict[str, Entry] = {}
    headers, sizes = {}, {}
    for file, names in split.filename_to_tensors.items():
        described = [
            (n, chosen[n][2], tuple(sized[n].shape), sized[n].numel() * sized[n].element_size()) for n in names
        ]
        header, offsets = _header(described)
        headers[file] = header
        sizes[file] = len(header) + sum(d[3] for d in described)
        for (name, _, _, nbytes), offset in zip(described, offsets, strict=True):
            tensor, rows, cast = chosen[name]
            begin = len(header) + offset
            placed[name] = Entry(name, tensor, rows, cast, file, begin, begin + nbytes, merges.get(name))

    by_source: dict[int, list[Entry]] = {}
    for entry in placed.values():
        by_source.setdefault(id(entry.source), []).append(entry)
    units: list[tuple[Entry, ...]] = []
    for params in _unit_params(sharded):
        units.append(tuple(e for p in params for e in by_source.pop(id(p), [])))
    units.append(tuple(e for entries in by_source.values() for e in entries))  # buffers, unsharded parameters

    index = None
    if split.is_sharded:
        index = {
            "metadata": {"total_parameters": model.num_parameters(), **split.metadata},  # pyright: ignore[reportCallIssue]
            "weight_map": split.tensor_to_filename,
        }
    return ExportPlan(tuple(e for unit in units for e in unit), tuple(units), headers, sizes, index)
