"""Distributed export preparation: every rank prepares its part, or every rank aborts.

One flow for every parallelism; what differs (what a rank holds, who writes)
is asked of the parallelism's export side (`parallel/export_side.py`). The
preparation runs in phases; after each, the ranks exchange their status
(`all_gather_object`), so all of them take the same decision:

1. weights: every rank digests what it holds. Replicas must agree (ranks
   that disagree are named; a diverged replica is never published), and
   their digest is the checkpoint's; shards differ by design, and the
   checkpoint's digest is the sha256 of the ranks' digests in rank order
   (so a staging is reused only at the world size that wrote it), the
   per-rank digests going into the manifest's provenance;
2. write: rank 0 reuses a staging whose manifest still verifies with this
   digest, or writes the files (`checkpoint_layout.write_checkpoint_files`)
   into `<staging>.tmp`: alone when it holds the model whole; else it makes
   the staging, and then every rank takes part in writing the files from the
   shards (each tensor gathered one at a time, rank 0 writing, every rank
   comparing the rows it owns bitwise with its shard as it goes);
3. verify: every rank hashes its share of the staged files for the manifest
   (file i goes to rank i mod W); a rank that holds the model whole first
   loads each safetensors file and compares every tensor it also holds
   bitwise with its own;
4. manifest: rank 0 writes it (provenance included); once every rank has
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
from trainer_core.export import build_export_tokenizer
from trainer_core.files import tensors_sha256
from trainer_core.parallel.export_side import export_side_of
from trainer_core.run.checkpoint_layout import write_checkpoint_files
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
    directory: Path, files: list[Path], own: dict[str, torch.Tensor] | None, true_vocab: int | None
) -> list[FileEntry]:
    """Hash this rank's files for the manifest, first checking every tensor of them against its own weights
    `own` (None: its rows were checked as the files were written); `true_vocab`: rows the export keeps of
    padded ones."""
    entries = []
    for path in files:
        if own is not None and path.suffix == ".safetensors":
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
    side = export_side_of(trainer)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    try:

        def check_weights() -> str:
            inject_fault(topology.rank, "weights")
            return tensors_sha256(side.held_weights(trainer))

        digests = _phase(topology, "checking its weights", check_weights)
        disagreeing = side.diverged_ranks(digests)
        if disagreeing:
            raise ExportPreparationError(
                f"ranks {disagreeing} hold weights that differ from rank 0's; refusing to export a diverged replica"
            )
        digest, digest_provenance = side.export_digest(digests)

        def write_the_files() -> None:
            tokenizer = build_export_tokenizer(config) if topology.rank == 0 else None
            write_checkpoint_files(config, trainer, tmp, tokenizer, side, writes_files=topology.rank == 0)

        def reuse_or_write() -> bool:
            inject_fault(topology.rank, "write")
            if topology.rank != 0:
                return False
            staged = verify_staged(out_dir)
            if staged is not None and staged.get("weights_sha256") == digest:
                return True
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            if not side.writes_export_together:
                write_the_files()
            return False

        reused = _phase(topology, "writing the checkpoint files", reuse_or_write)[0]
        if not reused:
            if side.writes_export_together:
                # Collective: a failure on any rank raises ShardedExportError on every rank, inside this phase.
                _phase(topology, "writing the checkpoint files from the shards", write_the_files)
            share = staged_files(tmp)[topology.rank :: topology.world_size]
            own = side.staged_tensors_to_check(trainer)

            def verify() -> list[FileEntry]:
                inject_fault(topology.rank, "verify")
                return _verify_share(tmp, share, own, trainer.vocab_size)

            entries = _phase(topology, "verifying its share of the files", verify)

            def write_the_manifest() -> None:
                inject_fault(topology.rank, "manifest")
                if topology.rank == 0:
                    manifest = manifest_of(
                        [e for part in entries for e in part],
                        {**provenance, "weights_sha256": digest, **digest_provenance},
                    )
                    write_checkpoint_manifest(tmp, manifest)

            _phase(topology, "writing the manifest", write_the_manifest)
            take_its_place(topology, tmp, out_dir)
    except ExportPreparationError:
        if topology.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"reused": reused, "weights_sha256": digest}
