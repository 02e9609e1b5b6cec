"""The checkpoint's files from a sharded trainer: `checkpoint_layout.write_checkpoint_files`' layout, from the shards.

The same files in the same places as the unsharded run writes (see
`checkpoint_layout.py`): the full model (`sharded_export.export_sharded_hf`),
or for `[model.lora]` the adapter in PEFT layout
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

import os
from pathlib import Path

import torch

from trainer_core.config import RunConfig
from trainer_core.run.checkpoint_layout import BASE_DIR, HEADS_DIR, MERGED_DIR, _name_base
from trainer_core.training import Trainer, export_checkpoint_module
from trainer_core.training.sharded_adapter import export_sharded_adapter
from trainer_core.training.sharded_export import export_sharded_hf


def write_sharded_checkpoint_files(config: RunConfig, trainer: Trainer, directory: Path, rank: int, tokenizer) -> None:
    """Every file of the checkpoint but its manifest into `directory` (which exists, empty). `tokenizer`: rank 0's."""
    sharded = trainer.sharding
    assert sharded is not None, "write_sharded_checkpoint_files writes a sharded trainer's files"
    dtype = torch.bfloat16 if config.train.dtype == "bfloat16" else None

    def model_files(target: Path, merge_adapter: str | None = None) -> None:
        export_sharded_hf(
            sharded,
            target,
            vocab_size=trainer.vocab_size,
            dtype=dtype,
            max_shard_size=config.export.max_shard_size,
            merge_adapter=merge_adapter,
        )

    def subdirectory(name: str) -> Path:
        path = directory / name
        if rank == 0:  # the other ranks only read it, after the export's first agreement
            path.mkdir(parents=True)
        return path

    adapters = [c.name for c in trainer.checkpoints.values() if c.kind == "lora"]
    model_dirs: list[Path] = []
    if not adapters:
        model_files(directory)
        model_dirs.append(directory)
    adapter_dirs = [directory] if len(adapters) == 1 else [subdirectory(name) for name in adapters]
    for name, adapter_dir in zip(adapters, adapter_dirs, strict=True):
        export_sharded_adapter(sharded, name, trainer.checkpoints[name].adapter_config, adapter_dir, dtype=dtype)
    if len(adapters) == 1:
        model_dirs.append(directory)
    if adapters and config.model.path is None:
        # Built from model.config and run.seed, the base exists nowhere else: ship it, and name it in each adapter.
        base = subdirectory(BASE_DIR)
        model_files(base)
        model_dirs.append(base)
        if rank == 0:
            for adapter_dir in adapter_dirs:
                _name_base(adapter_dir, os.path.relpath(base, adapter_dir))
    if config.export.merge_lora:
        if len(adapters) != 1:
            raise ValueError(f"export.merge_lora merges one adapter; this trainer has {len(adapters)} ({adapters})")
        merged = subdirectory(MERGED_DIR)
        model_files(merged, adapters[0])
        model_dirs.append(merged)
    if rank == 0:
        for name, checkpoint in trainer.checkpoints.items():
            if checkpoint.kind == "module":  # heads stay unsharded: every rank holds them whole
                export_checkpoint_module(trainer, name, directory / HEADS_DIR / name)
        for model_dir in model_dirs:
            tokenizer.save_pretrained(str(model_dir))
