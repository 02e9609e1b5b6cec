"""Save and restore a sharded checkpoint's training state with `torch.distributed.checkpoint` (DCP).

A checkpoint whose parameters are FSDP2 shards (DTensors) cannot be saved the
way `training.checkpoint_io.save_checkpoint` saves a replicated one (rank 0 writes the
whole tensors): no rank holds them whole, and gathering 100 GB of state onto
one rank is what sharding exists to avoid. Here every rank writes its own
shards of the weights and of the AdamW moments (DCP: one `__<rank>_0.distcp`
per rank and a `.metadata` the coordinator writes, straight to the disk:
`dcp_direct_write`), beside `version.json`
(name, kind, identity, revision), so the directory travels as run-state files
like any other.

Restoring reshards: DCP reads each target tensor's rows from whichever files
hold them, so a state saved by W processes restores at any other W, and into
an unsharded model too (with its AdamW state when that model has no FP32
masters, i.e. is not bf16; a bf16 one takes the weights only). The optimizer
state is keyed by parameter name (`get_optimizer_state_dict`), never by
position, so it lands on the right tensor whatever the layout.

Both functions are collective: every rank of the checkpoint's mesh calls them
with the same directory, which all ranks see (one local or shared directory).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from trainer_core.training.checkpoints import Checkpoint
from trainer_core.training.dcp_checked_read import CheckedReader, PlainValuesPlanner, stored_metadata

from .dcp_direct_write import direct_writer

__all__ = ["DCP_DIR", "is_sharded", "missing_shard_files", "restore_sharded_checkpoint", "save_sharded_checkpoint"]

DCP_DIR = "dcp"
VERSION_FILE = "version.json"


def is_sharded(checkpoint: Checkpoint) -> bool:
    """Whether any of the checkpoint's parameters is a DTensor (an FSDP2 shard)."""
    return any(isinstance(p, DTensor) for p in checkpoint.parameters().values())


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_sharded_checkpoint(checkpoint: Checkpoint, directory: Path) -> None:
    """Write the checkpoint's shards, AdamW state and revision under `directory` (collective)."""
    directory.mkdir(parents=True, exist_ok=True)
    params = {name: param.detach() for name, param in checkpoint.parameters().items()}
    optimizer = get_optimizer_state_dict(checkpoint.owner, checkpoint.optimizer)
    dcp_save({"params": params, "optimizer": optimizer}, storage_writer=direct_writer(directory / DCP_DIR))
    if _is_writer():
        version = {
            "name": checkpoint.name,
            "kind": checkpoint.kind,
            "identity": checkpoint.identity,
            "revision": checkpoint.revision,
            "format": "dcp",
        }
        (directory / VERSION_FILE).write_text(json.dumps(version))
    if dist.is_initialized():
        dist.barrier()  # no rank reports the state saved before version.json exists


def missing_shard_files(directory: Path) -> list[str]:
    """The shard files the checkpoint's DCP metadata names that are not in `directory` (written on another machine).

    The names are checked before any is looked at (`dcp_checked_read`: plain file names; a link is no file)."""
    dcp_dir = directory / DCP_DIR
    names = {info.relative_path for info in stored_metadata(dcp_dir).storage_data.values()}
    return sorted(name for name in names if not (dcp_dir / name).is_file() or (dcp_dir / name).is_symlink())


def restore_sharded_checkpoint(checkpoint: Checkpoint, directory: Path, *, with_optimizer: bool = True) -> None:
    """Load a state `save_sharded_checkpoint` wrote, at this world size and layout (collective).

    The checkpoint gets a new identity (graphs recorded before cannot be backwarded) and no gradient. With
    `with_optimizer=False` only the weights and revision are read: the optimizer keeps whatever state it has (as
    `checkpoint_io.restore_checkpoint` does; for an export, which never steps). Damaged or missing files raise
    ValueError naming the directory. DCP checks sizes, not contents: a flipped byte is caught by the run-state
    bundle's sha256, which every download verifies. What the files name is checked before it is read: a shard
    file outside `dcp/`, or a metadata pickle that names anything but DCP's types, raises ValueError too.
    """
    meta = json.loads((directory / VERSION_FILE).read_text())
    if meta.get("format") != "dcp":
        raise ValueError(f"{directory} holds a replicated checkpoint state; restore it with restore_checkpoint")
    if meta["kind"] != checkpoint.kind:
        raise ValueError(
            f"{directory} holds a '{meta['kind']}' checkpoint, not '{checkpoint.kind}'; "
            "restore it into a checkpoint of that kind"
        )
    if with_optimizer and not is_sharded(checkpoint) and checkpoint.master_weights():
        # AdamW steps the FP32 masters, which are no module's parameters: DCP's optimizer state dict cannot name
        # them (it would fail on a bare KeyError).
        raise ValueError(
            f"cannot restore the AdamW state of the sharded state in {directory} into '{checkpoint.name}', an "
            "unsharded checkpoint with FP32 master weights (a bf16 model): restore it with with_optimizer=False "
            '(the weights only), or into a sharded checkpoint (train.sharding = "fsdp")'
        )
    # Templates, not the live tensors: DCP writes in place, and the live weights change only through the
    # checkpoint's own load (one copy, after everything was read).
    params = {name: torch.empty_like(param.detach()) for name, param in checkpoint.parameters().items()}
    state: dict = {"params": params}
    if with_optimizer:
        # Materialises the AdamW state tensors (a zero-learning-rate step) so DCP has targets to load into.
        state["optimizer"] = get_optimizer_state_dict(checkpoint.owner, checkpoint.optimizer)
    # Nothing the stored files name is trusted: the metadata is unpickled safely and every shard file it names
    # checked (a plain file name in dcp/, holding its bytes) before any is opened (dcp_checked_read.py).
    reader = CheckedReader(directory / DCP_DIR)
    try:
        dcp_load(state, storage_reader=reader, planner=PlainValuesPlanner())
    except CheckpointException as failed:  # a BaseException: callers' `except Exception` would miss it
        if reader.refusal is not None:  # this rank's own check refused the state: its message says why
            raise reader.refusal from None
        first = str(failed).strip().splitlines()[0] if str(failed).strip() else type(failed).__name__
        raise ValueError(
            f"the sharded state in {directory} cannot be read ({first[:200]}); its files are damaged or "
            "incomplete: resume from the stored run-state bundle, whose digests are verified"
        ) from None
    if with_optimizer:
        set_optimizer_state_dict(checkpoint.owner, checkpoint.optimizer, state["optimizer"])
    checkpoint.load_state_dict({"params": params, "optimizer": None, "revision": meta["revision"]})
