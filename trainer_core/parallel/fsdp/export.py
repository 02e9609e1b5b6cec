"""Write a sharded model (FSDP2, `sharding.shard_model`) as a Hugging Face checkpoint, one tensor gathered at a time.

The unsharded export (`hf_weights.save_hf_model`) holds the whole model on
one process. Here no rank ever holds more than one full tensor of it (one
peft layer when merging; `full_tensor()` is an all-gather, so every rank
holds that tensor for the moment it is written):

1. **plan** (`export_plan.py`; every rank, no collective, from the global shapes alone): the
   tensors `save_hf_model` would write, under the same names (peft's
   `.base_layer` folded away, adapters left out, per-token rows cut to the
   true vocabulary, tied weights written once, by transformers' own rule), in
   the same files (huggingface_hub's split over the same storage sizes), each
   file's header as safetensors lays it out (tensors by descending dtype, then
   name; the header padded to 8 bytes). The files are therefore byte for byte
   the unsharded model's export of the same weights;
2. **write** (collective): for each FSDP unit in order (embedding, decoder
   layers, [norm, lm_head], root), every rank gathers each of its tensors
   (`full_tensor()`); rank 0 cuts and casts it to the export dtype (an FP32
   master cast to bf16 is bitwise the unsharded bf16 run's parameter) and
   writes its bytes at the planned offset of a file whose header was written
   first, then drops it. Rank 0 writes `config.json` (the true vocabulary, the
   export dtype) and `generation_config.json` as `save_pretrained` does;
3. **verify** (collective): each rank reads back, from the written files,
   only the rows it owns (`safe_open(...).get_slice`) and compares them
   bitwise with its own shard cast to the export dtype; rank 0 checks the
   replicated tensors. Each file's tensor names, dtypes and shapes are checked
   against the plan on every rank.

After the write and after the verify the ranks exchange their outcome
(`all_gather_object`): a failure on any rank raises ShardedExportError on every
rank, naming the first failing rank and its cause. A write error on rank 0
does not stop it from joining the remaining gathers, so no rank is left
waiting in a collective.

With `merge_adapter=NAME` (the `merged/` export), each peft layer holding
the adapter is gathered whole (its base weights and its adapters, cast to the
export dtype first, as the unsharded run's weights are in that dtype) and
merged by peft exactly as `hf_weights.save_hf_model` merges it, one layer at a
time; the merged tensors' values are not compared in the verify phase (no rank
holds them; the unsharded export does not compare them either), their names,
dtypes and shapes are.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Unpack

import safetensors
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from trainer_core.training.hf_weights import _merged_layer
from trainer_core.training.vocab import true_vocab_config

from .export_plan import DTYPE_CODES, INDEX_FILE, Entry, ExportOptions, ExportPlan, export_dtype, plan_export
from .shard import ShardedModel

__all__ = [
    "ExportReport",
    "ShardedExportError",
    "agree",
    "export_sharded_hf",
    "failure",
    "rank_of",
    "verify_rows",
    "verify_sharded_hf",
]


class ShardedExportError(RuntimeError):
    """The sharded export failed on some rank; every rank raises it."""


@dataclass(frozen=True)
class ExportReport:
    """What the export did on this rank."""

    files: tuple[str, ...]  # weight files (and the index), in the plan's order
    peak_gathered_bytes: int  # most bytes of gathered (and cast) full tensors alive at once on this rank
    largest_unit_bytes: int  # the largest FSDP unit's full tensors, in their training dtype
    verified_bytes: int  # tensor bytes this rank read back and compared


def _rank_group(model: nn.Module) -> tuple[int, int, Any]:
    """(rank, world size, process group) of the mesh the model is sharded over; (0, 1, None) when unsharded."""
    for param in model.parameters():
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            if mesh.ndim == 2:  # HSDP's (replicas, shards): every process of the run takes part, world rank 0 writes
                return dist.get_rank(), dist.get_world_size(), None
            if mesh.ndim != 1:
                raise ValueError(f"sharded export supports a 1-D or 2-D device mesh; this model's is {mesh.ndim}-D")
            return mesh.get_local_rank(), mesh.size(), mesh.get_group()
    return 0, 1, None


def failure(error: BaseException) -> str:
    """How a rank reports its failure to the others: the exception's type and message."""
    return f"{type(error).__name__}: {error}"


def rank_of(model: nn.Module) -> int:
    """This process's rank in the mesh the model is sharded over (0 when unsharded)."""
    return _rank_group(model)[0]


def agree(model: nn.Module, what: str, error: str | None) -> None:
    """Exchange every rank's outcome of a phase; raise ShardedExportError on every rank if any failed."""
    rank, world_size, group = _rank_group(model)
    outcomes: list[Any] = [(rank, error)]
    if world_size > 1:
        outcomes = [None] * world_size
        dist.all_gather_object(outcomes, (rank, error), group=group)
    failed = [(r, e) for r, e in outcomes if e is not None]
    if failed:
        first, cause = failed[0]
        others = f" (and ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
        raise ShardedExportError(
            f"sharded export failed on rank {first}{others} while {what}: {cause}; every rank aborted the export"
        )


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _exported(entry: Entry, whole: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the gathered whole tensor, its exported form: cut and cast) of one entry (collective for a DTensor).

    `whole`: the tensor's value when it is not the source's (a merged one).
    """
    if whole is None:
        source = entry.source.detach()
        whole = source.full_tensor() if isinstance(source, DTensor) else source
    kept = whole if entry.rows is None else whole[: entry.rows]
    return whole, kept.to(entry.dtype).contiguous()


def _merged(module_name: str, module: nn.Module, adapter: str, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """peft's merge of `adapter` into a whole copy of the layer (collective: gathers each of its tensors)."""
    memo: dict[int, Any] = {}
    with torch.no_grad():
        for param in module.parameters():  # the same order on every rank
            detached = param.detach()
            whole = detached.full_tensor() if isinstance(detached, DTensor) else detached.clone()
            memo[id(param)] = nn.Parameter(whole.to(export_dtype(whole, dtype)), requires_grad=False)
    plain = copy.deepcopy(module, memo)  # the layer over the whole tensors, in the export dtype
    return {name.replace(".base_layer", ""): t for name, t in _merged_layer(plain, module_name, adapter).items()}


def _write_config(model: nn.Module, directory: Path, true_size: int, dtype_name: str) -> None:
    """config.json and generation_config.json, as save_pretrained writes them for this model in the export dtype."""
    config: Any = model.config
    saved = config.dtype, config.architectures
    with true_vocab_config(model, true_size):
        config.dtype = dtype_name
        config.architectures = [type(model).__name__.removeprefix("FSDP")]
        try:
            config.save_pretrained(str(directory))
        finally:
            config.dtype, config.architectures = saved
    if model.can_generate():  # pyright: ignore[reportCallIssue]
        model.generation_config.save_pretrained(str(directory))  # pyright: ignore[reportCallIssue, reportAttributeAccessIssue]


def _write(sharded: ShardedModel, plan: ExportPlan, directory: Path, options: ExportOptions) -> ExportReport:
    """Write the weights and config into `directory` (which exists, empty: a staging), streamed from the shards.

    Collective: every rank of the model's mesh calls it with the same arguments; only rank 0 writes.
    """
    model = sharded.model
    rank = rank_of(model)
    vocab_size, dtype, merge_adapter = options.get("vocab_size"), options.get("dtype"), options.get("merge_adapter")
    error: str | None = None
    peak = 0
    with ExitStack() as files:
        handles: dict[str, BinaryIO] = {}
        if rank == 0:
            try:
                left = sorted(p.name for p in directory.iterdir())
                if left:
                    # A stale index or shard beside the new files would be what a loader reads (an index wins).
                    raise FileExistsError(
                        f"{directory} is not empty ({', '.join(left[:3])}); export into an empty staging"
                    )
                for file, header in plan.headers.items():
                    # Exclusive create: never through a symlink or onto a file that appeared since the check.
                    handle = files.enter_context(open(directory / file, "xb"))
                    handle.write(header)
                    handle.truncate(plan.sizes[file])
                    handles[file] = handle
            except OSError as failed:
                error = failure(failed)
        merged: dict[int, dict[str, torch.Tensor]] = {}  # a peft layer's merged tensors, until all are written
        for entry in plan.entries:
            if entry.merge is not None and merge_adapter is not None:
                module_name, module = entry.merge
                if id(module) not in merged:
                    merged[id(module)] = _merged(module_name, module, merge_adapter, dtype)
                layer = merged[id(module)]
                whole, exported = _exported(entry, layer.pop(entry.name))
                gathered = _nbytes(whole) + sum(_nbytes(t) for t in layer.values())
                if not layer:
                    del merged[id(module)]
            else:
                whole, exported = _exported(entry)
                gathered = _nbytes(whole) if isinstance(entry.source, DTensor) else 0
            peak = max(peak, gathered + (_nbytes(exported) if exported.data_ptr() != whole.data_ptr() else 0))
            # rank 0 keeps joining the gathers after a failure: no rank is left waiting in a collective.
            if rank == 0 and error is None:
                try:
                    handle = handles[entry.file]
                    handle.seek(entry.begin)
                    handle.write(exported.cpu().reshape(-1).view(torch.uint8).numpy().data)
                except OSError as failed:
                    error = failure(failed)
            del whole, exported  # before the next gather: one tensor's full copy at a time
    if rank == 0 and error is None:
        try:
            if plan.index is not None:
                (directory / INDEX_FILE).write_text(json.dumps(plan.index, indent=2, sort_keys=True) + "\n")
            embed: Any = model.get_input_embeddings()  # pyright: ignore[reportCallIssue]
            true_size = vocab_size if vocab_size is not None else embed.weight.shape[0]
            config_dtype = dtype or next(e.dtype for e in plan.entries if e.source.is_floating_point())
            _write_config(model, directory, true_size, str(config_dtype).split(".")[1])
        except OSError as failed:
            error = failure(failed)
    agree(model, "writing the checkpoint files", error)
    files_written = (*plan.headers, *([INDEX_FILE] if plan.index is not None else []))
    largest = max(sum(_nbytes(e.source) for e in unit) for unit in plan.units)
    return ExportReport(files_written, peak, largest, 0)


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN-safe, -0.0 told from 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _owned_rows(entry: Entry, rank: int) -> tuple[int, int, torch.Tensor] | None:
    """(first, stop, this rank's local rows) of the exported rows this rank verifies; None when it verifies none."""
    source = entry.source.detach()
    kept = entry.shape[0] if entry.shape else 0
    if isinstance(source, DTensor) and any(isinstance(p, Shard) for p in source.placements):
        if tuple(source.placements) not in ((Shard(0),), (Replicate(), Shard(0))):  # FSDP's, HSDP's
            raise ValueError(f"{entry.name}: placements {source.placements} (the export reads dim-0 shards only)")
        local_shape, offset = compute_local_shape_and_global_offset(source.shape, source.device_mesh, source.placements)
        first, stop = min(offset[0], kept), min(offset[0] + local_shape[0], kept)
        return (first, stop, source.to_local()[: stop - first]) if stop > first else None
    if rank != 0:
        return None  # a replicated tensor: rank 0 checks it
    local = source.to_local() if isinstance(source, DTensor) else source
    if isinstance(source, DTensor) and not all(isinstance(p, Replicate) for p in source.placements):
        raise ValueError(f"{entry.name}: placements {source.placements} are not supported by the sharded export")
    return 0, kept, local[:kept] if entry.shape else local


def _verify(plan: ExportPlan, directory: Path, rank: int) -> int:
    """Check the files' headers against the plan and this rank's rows bitwise; returns the tensor bytes read."""
    read = 0
    expected: dict[str, set[str]] = {}
    for entry in plan.entries:
        expected.setdefault(entry.file, set()).add(entry.name)
    with ExitStack() as stack:
        opened = {f: stack.enter_context(safetensors.safe_open(str(directory / f), framework="pt")) for f in expected}
        for file, names in expected.items():
            if set(opened[file].keys()) != names:
                raise ValueError(f"{file} holds tensors {sorted(opened[file].keys())}, the plan {sorted(names)}")
        for entry in plan.entries:
            part = opened[entry.file].get_slice(entry.name)
            if part.get_dtype() != DTYPE_CODES[entry.dtype] or tuple(part.get_shape()) != entry.shape:
                raise ValueError(
                    f"{entry.file}: tensor {entry.name} is {part.get_dtype()} {part.get_shape()}, "
                    f"the plan {DTYPE_CODES[entry.dtype]} {list(entry.shape)}"
                )
            owned = None if entry.merge is not None else _owned_rows(entry, rank)
            if owned is None:
                continue  # not this rank's rows, or a merged tensor (no rank holds its value)
            first, stop, mine = owned
            loaded = part[first:stop] if entry.shape else opened[entry.file].get_tensor(entry.name)
            read += _nbytes(loaded)
            if not _bitwise(loaded, mine.to("cpu", entry.dtype)):
                raise ValueError(f"{entry.file}: tensor {entry.name} rows {first}:{stop} differ from this rank's shard")
    return read


def verify_rows(model: nn.Module, plan: ExportPlan, directory: Path, what: str) -> int:
    """Every rank checks `plan`'s files in `directory` and its rows of them bitwise (collective); returns the bytes
    it read. Raises ShardedExportError on every rank, naming `what` it was doing, when any rank found a difference
    (or could not read the files)."""
    error, read = None, 0
    try:
        read = _verify(plan, directory, rank_of(model))
    except Exception as failed:  # noqa: BLE001 - reported to every rank, raised below
        error = failure(failed)
    agree(model, what, error)
    return read


def verify_sharded_hf(sharded: ShardedModel, directory: Path, **options: Unpack[ExportOptions]) -> int:
    """Every rank checks the rows it owns in `directory` against its shards (collective; the export's options).

    Returns the tensor bytes this rank read; raises ShardedExportError on every rank when any rank found a
    difference (or could not read the files).
    """
    return verify_rows(sharded.model, plan_export(sharded, **options), directory, "verifying its rows of the files")


def export_sharded_hf(sharded: ShardedModel, directory: Path, **options: Unpack[ExportOptions]) -> ExportReport:
    """Write the weights and config into `directory` (which exists, empty: a staging), then have every rank
    verify its rows of them (collective: every rank of the model's mesh calls it with the same arguments; only
    rank 0 writes). `options`: the export dtype of floating-point tensors (None: their own), the true vocabulary
    of a padded one, the file size past which the weights are split, the adapter to merge (module docstring)."""
    plan = plan_export(sharded, **options)
    written = _write(sharded, plan, directory, options)
    read = verify_rows(sharded.model, plan, directory, "verifying its rows of the files")
    return dataclasses.replace(written, verified_bytes=read)
