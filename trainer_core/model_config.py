"""Read the Hugging Face config a run's model is built from, and the peft LoRA config of `[model.lora]`.

Both the model builder (`model`) and the pre-flight checks (`model_checks`)
need these; they live here so that neither imports the other.
`read_model_config` reads `model.config` or `model.path/config.json` with
errors that name the file, the key and the fix; `quiet_transformers` keeps
transformers' warnings out of that one message. transformers is imported
where it is used: a config whose JSON is wrong is reported without it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from .config import LoraSection, RunConfig
from .errors import ConfigError
from .input_files import check_input_dir, read_input_json_object

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Sizes every causal LM config has (when it has them at all) and that must be positive:
# zero or a negative count builds an empty or broken model without any error from transformers.
POSITIVE_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
_CONFIG_FIX = "point model.config at a Hugging Face config.json (with model_type) for a random-initialised model"
PATH_FIX = (
    "point model.path at a Hugging Face model directory (config.json and weights, as save_pretrained writes them)"
)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' warnings and progress bars while checking: bad input gets one message."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def config_source(config: RunConfig) -> tuple[Path, str, str]:
    """The config.json to read, how to name it in messages, and the fix."""
    if config.model.path is not None:
        directory = check_input_dir(config.model.path, f"model.path={config.model.path!r}", PATH_FIX)
        file = directory / "config.json"
        if not file.exists():
            raise ConfigError(f"model.path={config.model.path!r}: the directory has no config.json; {PATH_FIX}")
        return file, f"model.path={config.model.path!r}", PATH_FIX
    assert config.model.config is not None  # ModelSection sets exactly one of model.path and model.config
    return Path(config.model.config), f"model.config={config.model.config!r}", _CONFIG_FIX


def _check_sizes(raw: dict, file: Path, fix: str) -> None:
    for key in POSITIVE_SIZES:
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(
                f"{file}: {key}={value!r} must be a positive whole number; set it to the model's real {key}, or {fix}"
            )


def read_model_config(config: RunConfig) -> PretrainedConfig:
    """The Hugging Face config of `config.model`, or a ConfigError naming the file, the key and the fix."""
    file, label, fix = config_source(config)
    raw = read_input_json_object(file, label, fix)
    model_type = raw.get("model_type")
    if model_type is None:
        raise ConfigError(f"{file}: has no 'model_type'; add one such as \"qwen3\", or {fix}")
    if not isinstance(model_type, str):
        raise ConfigError(f'{file}: model_type={model_type!r} must be a string such as "qwen3"')
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ConfigError(
            f"{file}: model_type={model_type!r} is not a model type transformers knows; "
            'use one such as "qwen3" or "llama"'
        )
    _check_sizes(raw, file, fix)
    from transformers import AutoConfig

    with quiet_transformers():
        try:
            if config.model.path is not None:
                model_config = AutoConfig.from_pretrained(config.model.path, local_files_only=True)
            else:
                model_config = AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "model_type"})
        except Exception as error:  # noqa: BLE001 - configs validate with several exception types
            raise ConfigError(
                f"{file}: not a valid {model_type} config ({one_line(error)}); fix it, or {fix}"
            ) from None
    kernel = config.model.attn_implementation
    if kernel in ("eager", "sdpa"):
        # The pre-flight's meta models (forward check, memory prediction) run the run's kernel: eager keeps the
        # T x T attention probabilities. flash_attention_2 cannot run on meta; the fused prediction is its.
        model_config._attn_implementation = kernel
    return model_config


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 300 else text[:297] + "..."


def peft_lora_config(config: RunConfig, lora: LoraSection):
    """The peft LoraConfig of `[model.lora]` (its adapter_config.json names the base model when it is a directory)."""
    from peft import LoraConfig

    # peft annotates lora_alpha as int, but only divides it by r: a float alpha (what [model.lora] allows) works.
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # pyright: ignore[reportArgumentType]
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
        base_model_name_or_path=config.model.path,
    )
