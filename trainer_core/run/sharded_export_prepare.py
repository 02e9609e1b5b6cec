"""Export preparation for a sharded model (`train.sharding = "fsdp"`): every rank's shards, no rank holding them all.

The phases and the coordinated failure are `export_prepare`'s (`_phase`: every
rank learns every rank's outcome after each one); what each phase does differs
because no rank holds the weights whole:

1. weights: every rank digests its own shards; the checkpoint's digest is the
   sha256 of the ranks' digests in rank order (it depends on W, so a staging
   is reused only at the world size that wrote it), and the per-rank digests
   go into the manifest's provenance;
2. write: rank 0 reuses a staging whose manifest verifies with this digest, or
   makes `<staging>.tmp`; then every rank takes part in
   `sharded_checkpoint_layout.write_sharded_checkpoint_files` (the unsharded
   run's layout: the full model, or a LoRA adapter with its base and merged
   weights), whose exports gather one tensor at a time, have rank 0 write the
   files (byte for byte what `save_hf_model` / the unsharded adapter export
   write for the same weights), and make every rank read back the rows it
   owns and compare them bitwise with its shard; rank 0 writes the tokenizer;
3. verify: every rank hashes its share of the files for the manifest (file i
   goes to rank i mod W; the tensors were compared in the write phase);
4. manifest: rank 0, then the staging moves into place, as unsharded.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path

from trainer_core.config import RunConfig
from trainer_core.export import build_export_tokenizer
from trainer_core.files import tensors_sha256
from trainer_core.parallel import local_tensor
from trainer_core.run.distributed import Topology
from trainer_core.run.export_prepare import ExportPreparationError, _phase, take_its_place
from trainer_core.run.manifest import (
    FileEntry,
    file_entry,
    manifest_of,
    staged_files,
    verify_staged,
    write_checkpoint_manifest,
)
from trainer_core.run.sharded_checkpoint_layout import write_sharded_checkpoint_files
from trainer_core.training import Trainer


def prepare_sharded_export(
    topology: Topology,
    config: RunConfig,
    trainer: Trainer,
    out_dir: Path,
    provenance: dict,
    inject_fault: Callable[[int, str], None] | None = None,
) -> dict:
    """`export_prepare.prepare_export` for a sharded trainer (collective); returns what was done."""
    sharded = trainer.sharding
    assert sharded is not None, "prepare_sharded_export exports a sharded trainer"
    inject_fault = inject_fault or (lambda rank, phase: None)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    try:

        def check_weights() -> str:
            inject_fault(topology.rank, "weights")
            return tensors_sha256({name: local_tensor(t) for name, t in trainer.model.state_dict().items()})

        digests = _phase(topology, "checking its weights", check_weights)
        digest = hashlib.sha256("".join(digests).encode()).hexdigest()

        def reuse_or_make_the_staging() -> bool:
            inject_fault(topology.rank, "write")
            if topology.rank != 0:
                return False
            staged = verify_staged(out_dir)
            if staged is not None and staged.get("weights_sha256") == digest:
                return True
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            return False

        reused = _phase(topology, "writing the checkpoint files", reuse_or_make_the_staging)[0]
        if not reused:

            def write_from_the_shards() -> None:
                # Collective: a failure on any rank raises ShardedExportError on every rank, inside this phase.
                tokenizer = build_export_tokenizer(config) if topology.rank == 0 else None
                write_sharded_checkpoint_files(config, trainer, tmp, topology.rank, tokenizer)

            _phase(topology, "writing the checkpoint files from the shards", write_from_the_shards)
            share = staged_files(tmp)[topology.rank :: topology.world_size]

            def hash_the_share() -> list[FileEntry]:
                inject_fault(topology.rank, "verify")
                return [file_entry(tmp, path) for path in share]

            entries = _phase(topology, "verifying its share of the files", hash_the_share)

            def write_the_manifest() -> None:
                inject_fault(topology.rank, "manifest")
                if topology.rank == 0:
                    manifest = manifest_of(
                        [e for part in entries for e in part],
                        {**provenance, "weights_sha256": digest, "rank_weights_sha256": digests},
                    )
                    write_checkpoint_manifest(tmp, manifest)

            _phase(topology, "writing the manifest", write_the_manifest)
            take_its_place(topology, tmp, out_dir)
    except ExportPreparationError:
        if topology.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"reused": reused, "weights_sha256": digest}
