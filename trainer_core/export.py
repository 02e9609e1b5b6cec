"""Turn a training state into an inference checkpoint in Hugging Face layout.

The directory holds the model's files — `config.json` and safetensors weights
(sharded with an index past `export.max_shard_size`, as `save_pretrained`
does it), or a PEFT adapter, and the merged weights when asked: which files,
by what the run trained, is `checkpoint_layout.py`'s — the tokenizer with the
chat template training used, and `MANIFEST.json` written last.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from trainer_core.parallel.export_side import export_side_of
from trainer_core.run.checkpoint_layout import write_checkpoint_files
from trainer_core.run.manifest import write_manifest

from .config import RunConfig
from .data import CHATML_TEMPLATE, load_tokenizer
from .training import Trainer


def build_export_tokenizer(config: RunConfig) -> PreTrainedTokenizerFast:
    tokenizer_path = Path(config.tokenizer.path)
    if tokenizer_path.is_dir() and (tokenizer_path / "tokenizer_config.json").is_file():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_path), local_files_only=True)
    else:
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=load_tokenizer(tokenizer_path))
        vocab = tokenizer.get_vocab()
        if "<|endoftext|>" in vocab:
            tokenizer.pad_token = "<|endoftext|>"
        if "<|im_end|>" in vocab:
            tokenizer.eos_token = "<|im_end|>"
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def write_export_files(config: RunConfig, trainer: Trainer, directory: Path) -> None:
    """Every file of the checkpoint but its manifest (which files: `checkpoint_layout.py`)."""
    write_checkpoint_files(config, trainer, directory, build_export_tokenizer(config), export_side_of(trainer))


def export_checkpoint(config: RunConfig, trainer: Trainer, out_dir: Path, manifest_extra: dict) -> dict:
    """Write the trainer's checkpoint into `out_dir` (replacing it) from one process and return its manifest."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_export_files(config, trainer, tmp)
    manifest = write_manifest(tmp, manifest_extra)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return manifest
