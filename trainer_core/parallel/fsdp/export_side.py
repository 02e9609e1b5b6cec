"""FSDP's export side: no rank holds the weights whole, so every rank takes part in writing the checkpoint.

The same files in the same places as the unsharded run writes
(`run/checkpoint_layout.py` decides them), their pieces written from the
shards: the full model by `fsdp.export.export_sharded_hf`, a LoRA adapter
in PEFT layout by `fsdp.adapter_export.export_sharded_adapter`. Every tensor is
gathered one at a time; rank 0 writes (byte for byte what the unsharded
export writes for the same weights, in the dtype the run trained in: an FP32
shard cast to bf16 is bitwise the unsharded bf16 run's parameter), then every
rank reads back the rows it owns and compares them bitwise with its shard; a
failure on any rank fails every rank (ShardedExportError).

The checkpoint's digest is the sha256 of the ranks' digests of their own
shards in rank order (it depends on the world size, so a staging is reused
only at the world size that wrote it); the per-rank digests go into the
manifest's provenance.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from trainer_core.parallel.fsdp import FullyShard
from trainer_core.parallel.fsdp.adapter_export import export_sharded_adapter
from trainer_core.parallel.fsdp.export import export_sharded_hf
from trainer_core.parallel.fsdp.shard import ShardedModel
from trainer_core.parallel.tensors import local_tensor

if TYPE_CHECKING:
    from trainer_core.config import RunConfig
    from trainer_core.training import Trainer


class FullyShardExportSide:
    """Every rank holds its shards: the ranks write the checkpoint together, rank 0 the files."""

    writes_export_together: ClassVar[bool] = True
    """Every rank gathers each tensor and checks its own rows of it; rank 0 writes the files."""

    def held_weights(self, trainer: Trainer) -> dict[str, torch.Tensor]:
        """This rank's shards of the weights."""
        return {name: local_tensor(tensor) for name, tensor in trainer.model.state_dict().items()}

    def diverged_ranks(self, digests: list[str]) -> list[int]:
        """None: each rank holds other rows of the weights, so their digests differ by design."""
        return []

    def export_digest(self, digests: list[str]) -> tuple[str, dict]:
        """The sha256 of the ranks' digests in rank order, and the per-rank digests for the provenance."""
        return hashlib.sha256("".join(digests).encode()).hexdigest(), {"rank_weights_sha256": digests}

    def export_model(self, config: RunConfig, trainer: Trainer, directory: Path, merge_adapter: str | None) -> None:
        """Write the full model (with `merge_adapter` merged in, if named) into `directory` (collective)."""
        export_sharded_hf(
            _sharded(trainer),
            directory,
            vocab_size=trainer.vocab_size,
            dtype=_export_dtype(config),
            max_shard_size=config.export.max_shard_size,
            merge_adapter=merge_adapter,
        )

    def export_adapter(self, config: RunConfig, trainer: Trainer, name: str, directory: Path) -> None:
        """Write adapter `name` in PEFT layout into `directory` (collective)."""
        adapter_config = trainer.checkpoints[name].adapter_config
        export_sharded_adapter(_sharded(trainer), name, adapter_config, directory, dtype=_export_dtype(config))

    def staged_tensors_to_check(self, trainer: Trainer) -> None:
        """None: each rank compared its own rows with its shards as the files were written."""
        return None


def _sharded(trainer: Trainer) -> ShardedModel:
    """The trainer's sharded model (what its FSDP units were made by)."""
    parallelism = trainer.parallelism
    assert isinstance(parallelism, FullyShard), "FSDP's export side exports a sharded trainer"
    return parallelism.sharded


def _export_dtype(config: RunConfig) -> torch.dtype | None:
    """The dtype the run trained in, when it is not the shards' own FP32."""
    return torch.bfloat16 if config.train.dtype == "bfloat16" else None
