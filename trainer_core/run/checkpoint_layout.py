"""Which files a checkpoint holds, by what the run trained (the manifest and the publication are `export.py`'s).

    full fine-tuning     config.json, generation_config.json, model*.safetensors, tokenizer files
                         → AutoModelForCausalLM.from_pretrained(DIR)
    [model.lora]         adapter_config.json, adapter_model.safetensors (PEFT layout), tokenizer files
                         → PeftModel.from_pretrained(base, DIR), or AutoPeftModelForCausalLM: the adapter's
                           config names its base (`base_model_name_or_path`): model.path as the run had it, or,
                           for model.config, "base", a directory of this checkpoint
      model.config       base/: config.json, model*.safetensors, tokenizer files: the frozen base that config and
                           run.seed built, which exists nowhere else → AutoModelForCausalLM.from_pretrained(DIR/base);
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

from trainer_core.config import RunConfig
from trainer_core.training import Trainer, export_checkpoint_module, save_hf_model

MERGED_DIR = "merged"
HEADS_DIR = "heads"
BASE_DIR = "base"
ADAPTER_CONFIG = "adapter_config.json"


def write_checkpoint_files(config: RunConfig, trainer: Trainer, directory: Path, tokenizer) -> None:
    """Write every file of the checkpoint but its manifest into `directory` (which exists)."""
    adapters = [c.name for c in trainer.checkpoints.values() if c.kind == "lora"]
    model_dirs = []
    if not adapters:
        save_hf_model(
            trainer.model, directory, vocab_size=trainer.vocab_size, max_shard_size=config.export.max_shard_size
        )
        model_dirs.append(directory)
    elif len(adapters) == 1:
        export_checkpoint_module(trainer, adapters[0], directory)
        model_dirs.append(directory)
    else:
        for name in adapters:
            export_checkpoint_module(trainer, name, directory / name)
    if adapters and config.model.path is None:
        # Built from model.config and run.seed, the base exists nowhere else: ship it, and name it in each adapter.
        save_hf_model(
            trainer.model,
            directory / BASE_DIR,
            vocab_size=trainer.vocab_size,
            max_shard_size=config.export.max_shard_size,
        )
        model_dirs.append(directory / BASE_DIR)
        for adapter_dir in [directory] if len(adapters) == 1 else [directory / name for name in adapters]:
            _name_base(adapter_dir, os.path.relpath(directory / BASE_DIR, adapter_dir))
    if config.export.merge_lora:
        if len(adapters) != 1:
            raise ValueError(f"export.merge_lora merges one adapter; this trainer has {len(adapters)} ({adapters})")
        merged = directory / MERGED_DIR
        merged.mkdir()
        save_hf_model(
            trainer.model,
            merged,
            vocab_size=trainer.vocab_size,
            merge_adapter=adapters[0],
            max_shard_size=config.export.max_shard_size,
        )
        model_dirs.append(merged)
    for name, checkpoint in trainer.checkpoints.items():
        if checkpoint.kind == "module":
            export_checkpoint_module(trainer, name, directory / HEADS_DIR / name)
    for model_dir in model_dirs:
        tokenizer.save_pretrained(str(model_dir))


def _name_base(adapter_dir: Path, base: str) -> None:
    """Set the adapter's `base_model_name_or_path` (peft's AutoPeftModel loads the base from it)."""
    path = adapter_dir / ADAPTER_CONFIG
    adapter_config = json.loads(path.read_text())
    adapter_config["base_model_name_or_path"] = Path(base).as_posix()
    path.write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
