"""Build the Hugging Face causal LM a run trains (from a local directory or a config), and its Trainer.

Nothing is downloaded: `model.path` is a local directory, `model.config` a
config.json for a randomly initialised model (tests and examples).
"""

from __future__ import annotations


import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from .checkpoints import OptimizerConfig
from .config import RunConfig
from .memory.planner import MemoryPlanner
from .model_checks import read_model_config
from .staleness import StalenessPolicy
from .trainer import Trainer


def load_model_config(config: RunConfig) -> PretrainedConfig:
    """The model's Hugging Face config (read and checked by `model_checks`)."""
    return read_model_config(config)


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


def build_trainer(config: RunConfig) -> Trainer:
    """The model of `config` in a Trainer with its checkpoint (full fine-tuning), as segments and exports use it."""
    train = config.train
    trainer = Trainer(
        build_model(config),
        staleness=StalenessPolicy(max_gradient_staleness=train.max_gradient_staleness),
        planner=MemoryPlanner(budget_bytes=train.saved_bytes_budget),
    )
    trainer.add_base_checkpoint(optimizer=OptimizerConfig(
        learning_rate=train.learning_rate, betas=train.betas, eps=train.eps,
        weight_decay=train.weight_decay, grad_clip=train.grad_clip,
    ))
    return trainer
