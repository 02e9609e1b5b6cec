"""Which files a checkpoint holds, by what the run trained (the manifest and the publication are `export.py`'s).

    full fine-tuning     config.json, generation_config.json, model*.safetensors, tokenizer files
                         → AutoModelForCausalLM.from_pretrained(DIR)
    [model.lora]         adapter_config.json, adapter_model.safetensors (PEFT layout), tokenizer files
                         → PeftModel.from_pretrained(base, DIR), or AutoPeftModelForCausalLM: the adapter's
                           config names its base (`base_model_name_or_path`): model.path as the run had it, or,
                           for a base shipped in base/, "base", a directory of this checkpoint
      model.config, or   base/: config.json, model*.safetensors, tokenizer files: the frozen base that config and
      a committed parent   run.seed built, or that was fetched from a committed checkpoint into the run's cache
                           (it exists nowhere else that lasts) → AutoModelForCausalLM.from_pretrained(DIR/base);
                           the name is relative to the adapter's directory (peft reads it from the current one)
      export.merge_lora  merged/: config.json, model*.safetensors (base + adapter), tokenizer files
                         → AutoModelForCausalLM.from_pretrained(DIR/merged)
    several adapters     NAME/ for each (PEFT's layout for named adapters)
    heads                heads/NAME/model.safetensors, one per module checkpoint

Weights are written in the dtype they trained in (float32, or bfloat16 with
`train.dtype`), over the true vocabulary when the rows were padded; peft's
wrappers never show in a full model's names (`training/hf_weights.py`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from trainer_core.config import RunConfig
from trainer_core.run.parent_record import run_parent
from trainer_core.training import Trainer, export_checkpoint_module

if TYPE_CHECKING:
    from trainer_core.parallel.export_side import ReplicatedExportSide
    from trainer_core.parallel.fsdp.export_side import FullyShardExportSide

    ExportSide = ReplicatedExportSide | FullyShardExportSide

MERGED_DIR = "merged"
HEADS_DIR = "heads"
BASE_DIR = "base"
ADAPTER_CONFIG = "adapter_config.json"


def write_checkpoint_files(
    config: RunConfig,
    trainer: Trainer,
    directory: Path,
    tokenizer,
    side: ExportSide,
    *,
    writes_files: bool = True,
) -> None:
    """Write every file of the checkpoint but its manifest into `directory` (which exists, empty).

    `side`: how the pieces are written, the parallelism's export side (`parallel/export_side.py`): by the one
    process that holds the model whole, or collectively from shards. `writes_files`: this process writes the
    files only one process writes (directories, the base's name in each adapter's config, heads, tokenizer):
    True but on the other ranks of a collective export. `tokenizer`: used where `writes_files`.
    """

    def subdirectory(name: str) -> Path:
        path = directory / name
        if writes_files:  # a collective export's other ranks only read it, after its first agreement
            path.mkdir(parents=True)
        return path

    adapters = [c.name for c in trainer.checkpoints.values() if c.kind == "lora"]
    model_dirs: list[Path] = []
    if not adapters:
        side.export_model(config, trainer, directory, None)
        model_dirs.append(directory)
    adapter_dirs = [directory] if len(adapters) == 1 else [subdirectory(name) for name in adapters]
    for name, adapter_dir in zip(adapters, adapter_dirs, strict=True):
        side.export_adapter(config, trainer, name, adapter_dir)
    if len(adapters) == 1:
        model_dirs.append(directory)
    if adapters and (config.model.path is None or run_parent(config) is not None):
        # Built from model.config and run.seed, the base exists nowhere else: ship it, and name it in each adapter.
        # So for a base fetched from a committed checkpoint (a full model's, or the base of an adapter that
        # continues): it lies in this run's work dir, a cache, and a name pointing there would not outlive it.
        base = subdirectory(BASE_DIR)
        side.export_model(config, trainer, base, None)
        model_dirs.append(base)
        if writes_files:
            for adapter_dir in adapter_dirs:
                _name_base(adapter_dir, os.path.relpath(base, adapter_dir))
    if config.export.merge_lora:
        if len(adapters) != 1:
            raise ValueError(f"export.merge_lora merges one adapter; this trainer has {len(adapters)} ({adapters})")
        merged = subdirectory(MERGED_DIR)
        side.export_model(config, trainer, merged, adapters[0])
        model_dirs.append(merged)
    if not writes_files:
        return
    for name, checkpoint in trainer.checkpoints.items():
        if checkpoint.kind == "module":  # heads are never sharded: whoever writes holds them whole
            export_checkpoint_module(trainer, name, directory / HEADS_DIR / name)
    for model_dir in model_dirs:
        tokenizer.save_pretrained(str(model_dir))


def _name_base(adapter_dir: Path, base: str) -> None:
    """Set the adapter's `base_model_name_or_path` (peft's AutoPeftModel loads the base from it)."""
    path = adapter_dir / ADAPTER_CONFIG
    adapter_config = json.loads(path.read_text())
    adapter_config["base_model_name_or_path"] = Path(base).as_posix()
    path.write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
