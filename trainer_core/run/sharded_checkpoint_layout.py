"""The checkpoint's files from a sharded trainer: `checkpoint_layout.write_checkpoint_files`' layout, from the shards.

The same files in the same places as the unsharded run writes: the layout
is `checkpoint_layout.write_checkpoint_files`' own, given a `LayoutWriter`
that writes its pieces from the shards: the full model
(`sharded_export.export_sharded_hf`), or for `[model.lora]` the adapter in
PEFT layout
(`sharded_adapter.export_sharded_adapter`), the frozen base in `base/` when
`model.config` built it, the merged weights in `merged/` with
`export.merge_lora`, heads in `heads/NAME/`, and the tokenizer beside each
model. Every tensor is gathered one at a time, so no rank holds the model
whole; each export verifies each rank's own rows, and a failure on any rank
fails every rank (ShardedExportError).

Collective: every rank calls it with the same arguments; rank 0 writes (the
directories too), the other ranks gather and verify. Tensors are written in
the dtype the run trained in (`train.dtype`): an FP32 shard cast to bf16 is
bitwise the unsharded bf16 run's parameter.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainer_core.config import RunConfig
from trainer_core.run.checkpoint_layout import LayoutWriter, write_checkpoint_files
from trainer_core.training import Trainer
from trainer_core.training.sharded_adapter import export_sharded_adapter
from trainer_core.training.sharded_export import export_sharded_hf


def write_sharded_checkpoint_files(config: RunConfig, trainer: Trainer, directory: Path, rank: int, tokenizer) -> None:
    """Every file of the checkpoint but its manifest into `directory` (which exists, empty). `tokenizer`: rank 0's."""
    sharded = trainer.sharding
    assert sharded is not None, "write_sharded_checkpoint_files writes a sharded trainer's files"
    dtype = torch.bfloat16 if config.train.dtype == "bfloat16" else None

    def model(target: Path, merge_adapter: str | None) -> None:
        export_sharded_hf(
            sharded,
            target,
            vocab_size=trainer.vocab_size,
            dtype=dtype,
            max_shard_size=config.export.max_shard_size,
            merge_adapter=merge_adapter,
        )

    def adapter(name: str, target: Path) -> None:
        export_sharded_adapter(sharded, name, trainer.checkpoints[name].adapter_config, target, dtype=dtype)

    write_checkpoint_files(
        config, trainer, directory, tokenizer, LayoutWriter(model=model, adapter=adapter, writes_files=rank == 0)
    )
