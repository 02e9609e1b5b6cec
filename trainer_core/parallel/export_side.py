"""The export side of a parallelism: how a trainer's checkpoint is digested, written and checked on its ranks.

One export-prepare (`run/export_prepare.py`) and one checkpoint layout
(`run/checkpoint_layout.py`) serve every parallelism; what differs is asked
of the parallelism's export side (`export_side_of` picks it by `shards_weights`):

- `held_weights`: what this rank holds, digested in the first phase;
- `diverged_ranks` / `export_digest`: what the ranks' digests say (replicas
  must agree; shards differ by design) and the checkpoint's own digest;
- `writes_export_together`: whether one process that holds the model whole
  writes the files alone, or every rank takes part in writing them;
- `export_model` / `export_adapter`: how the layout's pieces are written;
- `staged_tensors_to_check`: what each rank compares the staged files'
  tensors with (None: its rows were compared as the files were written).

`ReplicatedExportSide` is the unsharded run's (every rank holds every
weight); `fsdp/export_side.py` is FSDP's. `export_side_of` picks a trainer's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from trainer_core.parallel.fsdp.export_side import FullyShardExportSide
from trainer_core.training.checkpoint_io import export_checkpoint_module
from trainer_core.training.hf_weights import save_hf_model

if TYPE_CHECKING:
    from trainer_core.config import RunConfig
    from trainer_core.training import Trainer


class ReplicatedExportSide:
    """Every rank holds every weight: rank 0 writes the checkpoint alone, every rank checks it against its own."""

    writes_export_together: ClassVar[bool] = False
    """Rank 0 writes every file; the other ranks only check their share of them."""

    def held_weights(self, trainer: Trainer) -> dict[str, torch.Tensor]:
        """This rank's whole weights (a replica: every rank's must be the same)."""
        return trainer.model.state_dict()

    def diverged_ranks(self, digests: list[str]) -> list[int]:
        """The ranks whose weights differ from rank 0's: a diverged replica is never published."""
        return [rank for rank, digest in enumerate(digests) if digest != digests[0]]

    def export_digest(self, digests: list[str]) -> tuple[str, dict]:
        """The checkpoint's weights digest (the replicas', all one) and the provenance it adds (none)."""
        return digests[0], {}

    def export_model(self, config: RunConfig, trainer: Trainer, directory: Path, merge_adapter: str | None) -> None:
        """Write the full model (with `merge_adapter` merged in, if named) into `directory`, which exists."""
        save_hf_model(
            trainer.model,
            directory,
            vocab_size=trainer.vocab_size,
            merge_adapter=merge_adapter,
            max_shard_size=config.export.max_shard_size,
        )

    def export_adapter(self, config: RunConfig, trainer: Trainer, name: str, directory: Path) -> None:
        """Write adapter `name` in PEFT layout into `directory`, which exists."""
        export_checkpoint_module(trainer, name, directory)

    def staged_tensors_to_check(self, trainer: Trainer) -> dict[str, torch.Tensor]:
        """Every rank compares each tensor of its share of the staged files with its own whole weights."""
        return trainer.model.state_dict()


def export_side_of(trainer: Trainer) -> ReplicatedExportSide | FullyShardExportSide:
    """The export side of the parallelism `trainer` runs under."""
    # Asked, not inherited: the parallelisms cannot inherit their export sides (the export writers import the
    # trainer library, which imports the parallelisms).
    return FullyShardExportSide() if trainer.parallelism.shards_weights else ReplicatedExportSide()
