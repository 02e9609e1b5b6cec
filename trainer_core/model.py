"""Build the Hugging Face causal LM a run trains: from a local directory or a config.

Nothing is downloaded: `model.path` is a local directory, `model.config` a
config.json for a randomly initialised model (tests and examples).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from .config import RunConfig


def load_model_config(config: RunConfig) -> PretrainedConfig:
    if config.model.path is not None:
        return AutoConfig.from_pretrained(config.model.path, local_files_only=True)
    raw = json.loads(Path(config.model.config).read_text())
    model_type = raw.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"model.config={config.model.config!r} has no 'model_type'; add one such as \"qwen3\"")
    return AutoConfig.for_model(model_type, **raw)


def model_vocab_size(config: RunConfig) -> int:
    return int(load_model_config(config).vocab_size)


def build_model(config: RunConfig) -> PreTrainedModel:
    """The initial model: pretrained weights, or a seeded random initialisation."""
    if config.model.path is not None:
        model = AutoModelForCausalLM.from_pretrained(config.model.path, local_files_only=True, dtype=torch.float32)
    else:
        # The same seed on every rank gives every rank the same initial weights
        # without a broadcast.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.run.seed)
            model = AutoModelForCausalLM.from_config(load_model_config(config), dtype=torch.float32)
    model.config.use_cache = False
    return model
