"""Export a LoRA adapter of a sharded model (peft injected before `shard_model`) in peft's layout.

The adapter's tensors live as dim-0 shards inside their decoder layers'
FSDP units. They are small (a few MB even for an 8B base), so every rank
gathers each of them (`full_tensor()`, collective, in the same order) and
rank 0 writes what the unsharded export (`training.checkpoint_io.export_checkpoint_module`)
writes: `adapter_model.safetensors` under the keys `PeftModel.from_pretrained`
expects (`base_model.model.` + peft's own), and `adapter_config.json`. The
file is byte for byte the unsharded one. Then every rank reads back the rows
it owns and compares them bitwise with its shards, as `fsdp.export` does
for the full model; a failure on any rank fails every rank
(ShardedExportError).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from trainer_core.training.adapter_config import save_adapter_config

from .export import agree, failure, rank_of, verify_rows
from .export_plan import Entry, ExportPlan, export_dtype
from .shard import ShardedModel

__all__ = ["ADAPTER_FILE", "export_sharded_adapter", "verify_sharded_adapter"]

ADAPTER_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."  # what peft's own wrapper prepends on save


def _adapter_state(sharded: ShardedModel, adapter: str) -> dict[str, torch.Tensor]:
    """The adapter's tensors (DTensors when sharded) under the names written to the file."""
    from peft import get_peft_model_state_dict

    # peft picks and renames the adapter's entries, but since 0.22 it also gathers every DTensor it returns
    # (a collective, and rank 0 would then verify every row). It is handed empty stand-ins instead, one per
    # entry of the model's state, and the stand-ins it keeps are mapped back to the sharded tensors.
    tensors = sharded.model.state_dict()
    stand_ins = {name: torch.empty(0) for name in tensors}
    by_stand_in = {id(stand_in): tensors[name] for name, stand_in in stand_ins.items()}
    state = get_peft_model_state_dict(sharded.model, state_dict=stand_ins, adapter_name=adapter)
    if not state:
        raise ValueError(f"the model holds no LoRA adapter named '{adapter}'; nothing to export")
    return {_PREFIX + name: by_stand_in[id(stand_in)] for name, stand_in in state.items()}


def _plan(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> ExportPlan:
    entries = tuple(Entry(name, t, None, export_dtype(t, dtype), ADAPTER_FILE, 0, 0) for name, t in state.items())
    return ExportPlan(entries, (entries,), {}, {}, None)


def verify_sharded_adapter(
    sharded: ShardedModel, adapter: str, directory: Path, *, dtype: torch.dtype | None = None
) -> int:
    """Every rank checks its rows of `directory`'s adapter file bitwise (collective); returns the bytes it read."""
    plan = _plan(_adapter_state(sharded, adapter), dtype)
    return verify_rows(sharded.model, plan, directory, "verifying its rows of the adapter")


def export_sharded_adapter(
    sharded: ShardedModel, adapter: str, adapter_config: Any, directory: Path, *, dtype: torch.dtype | None = None
) -> int:
    """Write adapter `adapter` (peft config `adapter_config`) into `directory` (which exists), then verify it.

    Collective: every rank calls it with the same arguments; only rank 0 writes. `dtype`: the export dtype of
    its tensors (None: their own; bf16 for a bf16 run, whose FP32 shards cast to bf16 are bitwise the unsharded
    run's bf16 adapter). Returns the bytes this rank verified. Raises ShardedExportError on every rank when any
    rank failed to write or verify.
    """
    rank = rank_of(sharded.model)
    state = _adapter_state(sharded, adapter)
    whole: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in state.items():
            gathered = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if rank == 0:
                whole[name] = gathered.to(export_dtype(gathered, dtype)).contiguous()
    error = None
    if rank == 0:
        try:
            save_file(whole, str(directory / ADAPTER_FILE))
            save_adapter_config(adapter_config, directory)
        except OSError as failed:
            error = failure(failed)
    del whole
    agree(sharded.model, "writing the adapter files", error)
    return verify_sharded_adapter(sharded, adapter, directory, dtype=dtype)
