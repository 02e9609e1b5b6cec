"""Refuse a run that cannot fit its training devices: the memory model (`trainer_core.memory_model`) at the config.

`check_device_memory(config, model_config, row_len)` predicts the bytes of the
most loaded rank for the run as configured (the model built on the meta device
in `train.dtype`, with its LoRA adapter and padded vocabulary; W =
`train.nnodes × train.nproc_per_node`; one logical rank's rows of the plan's
row length per forward) and compares the total with `train.device_memory_gb`,
or, unset, with the memory of this machine's CUDA device 0 (no check on a
machine without one). Past it: a `ConfigError` naming the key, the largest
terms, and the fixes in the order to try them. Called by `validate_inputs`,
so `rankflow run`, `rankflow deploy` and the plan stage all refuse before
anything is written.

The fixes offer `train.sharding = "fsdp"` (and more processes, which only
help a sharded model) where the config could take it: not with `[model.lora]`,
which is not sharded yet. Either reduction shards (a deterministic one keeps
its results, and its run id, at any W).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from trainer_core.config import RunConfig, TrainSection
from trainer_core.errors import ConfigError
from trainer_core.memory_model import (
    GB,
    LABELS,
    MemoryEstimate,
    MemorySettings,
    ModelShape,
    ParamShape,
    fixes,
    human,
    predict,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class MemoryReport:
    settings: MemorySettings
    estimate: MemoryEstimate
    limit_bytes: int | None
    """What it was compared with; None when no device memory is known (no check)."""
    limit_source: str


def can_shard() -> bool:
    return "sharding" in TrainSection.model_fields


def _advice(config: RunConfig, settings: MemorySettings) -> list[str]:
    lora = config.model.lora is not None
    return fixes(settings, lora=lora, can_shard=can_shard())


def memory_settings(config: RunConfig, row_len: int) -> MemorySettings:
    train = config.train
    return MemorySettings(
        sharding=train.sharding,
        world_size=train.nnodes * train.nproc_per_node,
        dtype=train.dtype,
        logical_dp=train.logical_dp,
        reduction=train.reduction,
        activation_checkpointing=train.activation_checkpointing,
        rows_per_logical_rank=train.rows_per_forward,  # one micro-batch's activations are alive at a time
        seq_len=row_len,
        nodes=train.nnodes,
    )


def _padded(shape: ModelShape, true_vocab: int, multiple: int | None) -> ModelShape:
    """The shape after model.pad_vocab_to_multiple_of: the vocabulary's rows padded (trainer_core/training/vocab.py)."""
    if multiple is None:
        return shape
    rows = -(-true_vocab // multiple) * multiple
    if rows == true_vocab:
        return shape

    def pad(p: ParamShape) -> ParamShape:
        return replace(p, rows=rows, numel=p.numel // true_vocab * rows) if p.rows == true_vocab else p

    units = tuple(replace(u, params=tuple(map(pad, u.params))) for u in shape.units)
    return replace(shape, units=units, vocab_rows=rows if shape.vocab_rows == true_vocab else shape.vocab_rows)


def run_model_shape(config: RunConfig, model_config: PretrainedConfig) -> ModelShape:
    """The shape of the model the run trains: meta device, `train.dtype`, LoRA injected, vocabulary padded."""
    from trainer_core.memory_shape import meta_model, model_shape
    from trainer_core.model_config import peft_lora_config

    model = meta_model(model_config, config.train.dtype)
    lora = config.model.lora
    if lora is not None:
        from peft import inject_adapter_in_model

        inject_adapter_in_model(peft_lora_config(config, lora), model, low_cpu_mem_usage=True)
    shape = model_shape(model, trainable=(lambda name: "lora_" in name) if lora is not None else (lambda name: True))
    return _padded(shape, int(model_config.vocab_size), config.model.pad_vocab_to_multiple_of)


def device_memory(config: RunConfig) -> tuple[int | None, str]:
    """The bytes to fit and where the figure comes from."""
    gb = config.train.device_memory_gb
    if gb is not None:
        return round(gb * GB), f"train.device_memory_gb={gb:g}"
    import torch

    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        return int(properties.total_memory), f"CUDA device 0 of this machine ({properties.name})"
    return None, "no device memory known (no CUDA device, train.device_memory_gb unset)"


def predict_run(config: RunConfig, model_config: PretrainedConfig, row_len: int) -> MemoryReport:
    from trainer_core.memory_shape import activation_fit

    settings = memory_settings(config, row_len)
    estimate = predict(
        run_model_shape(config, model_config), activation_fit(model_config, config.train.dtype), settings
    )
    limit, source = device_memory(config)
    return MemoryReport(settings=settings, estimate=estimate, limit_bytes=limit, limit_source=source)


def check_device_memory(config: RunConfig, model_config: PretrainedConfig, row_len: int) -> MemoryReport:
    """The prediction for this run; ConfigError when it exceeds the device's memory."""
    report = predict_run(config, model_config, row_len)
    estimate, limit = report.estimate, report.limit_bytes
    if limit is None or estimate.total <= limit:
        return report
    largest = sorted(((v, k) for k, v in estimate.terms().items() if v), reverse=True)[:3]
    terms = ", ".join(f"{LABELS[name]} {human(value)}" for value, name in largest)
    settings = report.settings
    advice = "; ".join(_advice(config, settings))
    where = (
        "set train.device_memory_gb to the training GPUs' memory if they are not this machine's"
        if config.train.device_memory_gb is None
        else "or raise train.device_memory_gb only if the devices really have more"
    )
    raise ConfigError(
        f"train.device_memory_gb: this run needs about {human(estimate.total)} per rank ({terms}; "
        f"W={settings.world_size}, {settings.rows_per_logical_rank} rows × {settings.seq_len} tokens per forward), "
        f"more than the {human(limit)} of {report.limit_source}; try, in order: "
        + (f"{advice}; " if advice else "")
        + f"lower train.global_batch_size or data.max_seq_len; {where}"
    )
