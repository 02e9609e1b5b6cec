"""Distributed export preparation: every rank prepares its part, or every rank aborts.

The preparation runs in phases; after each, the ranks exchange their status
(`all_gather_object`), so all of them take the same decision:

1. every rank checks what it holds: its weights' digest (ranks that disagree
   are named; a diverged replica is never published);
2. rank 0 reuses a staging whose manifest still verifies with these weights,
   or writes the files into `<staging>.tmp`;
3. every rank verifies its share of the staged files (file i goes to rank
   i mod W): it loads each safetensors file, compares every tensor it also
   holds bitwise with its own, and hashes the file for the manifest;
4. rank 0 writes the manifest (provenance included); once every rank has
   reported success, it moves the staging into place.

If any rank fails any phase, every rank raises ExportPreparationError naming
the first failing rank and its cause, and the temporary files are removed
(rank 0's `.tmp` staging: the other ranks write none). The host side then
marks the publication ABORTED (tasks/export.py). The phases read the files
rank 0 wrote, so ranks share the staging's filesystem (one node).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open

from trainer_core.config import RunConfig
from trainer_core.export import write_export_files
from trainer_core.files import tensors_sha256
from trainer_core.run.distributed import Topology
from trainer_core.run.manifest import (
    FileEntry,
    file_entry,
    manifest_of,
    staged_files,
    verify_staged,
    write_checkpoint_manifest,
)
from trainer_core.training import Trainer


class ExportPreparationError(RuntimeError):
    """Export preparation failed on some rank; every rank aborts this publication."""


@dataclass(frozen=True)
class _Status:
    rank: int
    error: str | None
    value: Any = None


def _phase(topology: Topology, what: str, action: Callable[[], Any]) -> list[Any]:
    """Run `action` on this rank, then learn every rank's outcome; raise on all ranks if any failed."""
    try:
        status = _Status(topology.rank, None, action())
    except Exception as error:  # noqa: BLE001 - reported to every rank, raised below
        status = _Status(topology.rank, f"{type(error).__name__}: {error}")
    statuses: list = [status]
    if topology.world_size > 1:
        statuses = [None] * topology.world_size
        dist.all_gather_object(statuses, status)
    failed = [s for s in statuses if s.error is not None]
    if failed:
        first = failed[0]
        others = f" (and ranks {[s.rank for s in failed[1:]]})" if len(failed) > 1 else ""
        raise ExportPreparationError(
            f"export preparation failed on rank {first.rank}{others} while {what}: "
            f"{first.error}; every rank aborted this publication"
        )
    return [s.value for s in statuses]


def _verify_share(
    directory: Path, files: list[Path], own: dict[str, torch.Tensor], true_vocab: int | None
) -> list[FileEntry]:
    """Check every tensor of this rank's files against its own weights; `true_vocab`: rows the export keeps of padded ones."""
    entries = []
    for path in files:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as tensors:
                for name in tensors.keys():
                    loaded = tensors.get_tensor(name)  # parses the header and reads every byte range
                    mine = own.get(name)
                    if mine is None:
                        continue  # adapter files and merged weights are named differently from the live module
                    mine = mine.detach().to("cpu", loaded.dtype)
                    if true_vocab is not None and loaded.shape[0] == true_vocab < mine.shape[0]:
                        mine = mine[:true_vocab]  # a padded vocabulary is cut to the true one on export
                    if not torch.equal(loaded, mine):
                        raise ValueError(f"{path.name}: tensor {name} differs from this rank's weights")
        entries.append(file_entry(directory, path))
    return entries


def take_its_place(topology: Topology, tmp: Path, out_dir: Path) -> None:
    """Every rank agreed on every phase: only now does rank 0 move the staging `tmp` into `out_dir`'s place."""
    if topology.rank == 0:
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)


def prepare_export(
    topology: Topology,
    config: RunConfig,
    trainer: Trainer,
    out_dir: Path,
    provenance: dict,
    inject_fault: Callable[[int, str], None] | None = None,
) -> dict:
    """Stage the checkpoint at `out_dir` with every rank's help; returns what was done.

    `inject_fault(rank, phase)` runs at the start of each phase on each rank
    (phases: weights, write, verify, manifest); tests make it raise.
    """
    inject_fault = inject_fault or (lambda rank, phase: None)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    own = trainer.model.state_dict()
    try:

        def check_weights() -> str:
            inject_fault(topology.rank, "weights")
            return tensors_sha256(own)

        digests = _phase(topology, "checking its weights", check_weights)
        disagreeing = [rank for rank, digest in enumerate(digests) if digest != digests[0]]
        if disagreeing:
            raise ExportPreparationError(
                f"ranks {disagreeing} hold weights that differ from rank 0's; refusing to export a diverged replica"
            )
        digest = digests[0]

        def reuse_or_write() -> bool:
            inject_fault(topology.rank, "write")
            if topology.rank != 0:
                return False
            staged = verify_staged(out_dir)
            if staged is not None and staged.get("weights_sha256") == digest:
                return True
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            write_export_files(config, trainer, tmp)
            return False

        reused = _phase(topology, "writing the checkpoint files", reuse_or_write)[0]
        if not reused:
            share = staged_files(tmp)[topology.rank :: topology.world_size]

            def verify() -> list[FileEntry]:
                inject_fault(topology.rank, "verify")
                return _verify_share(tmp, share, own, trainer.vocab_size)

            entries = _phase(topology, "verifying its share of the files", verify)

            def write_the_manifest() -> None:
                inject_fault(topology.rank, "manifest")
                if topology.rank == 0:
                    manifest = manifest_of(
                        [e for part in entries for e in part], {**provenance, "weights_sha256": digest}
                    )
                    write_checkpoint_manifest(tmp, manifest)

            _phase(topology, "writing the manifest", write_the_manifest)
            take_its_place(topology, tmp, out_dir)
    except ExportPreparationError:
        if topology.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"reused": reused, "weights_sha256": digest}
