"""Check the model a run trains before anything is written or launched.

`read_model_config` (`model_config`) reads `model.config` or
`model.path/config.json` with errors that name the file and the fix;
`check_model` then proves the model can be built and run: sizes are positive, a forward pass runs on the meta device
(shapes only, no memory, so head counts that do not divide fail here and not
on the ranks), the vocabulary covers the tokenizer and, for `model.path`, the
weights exist, are readable and hold every tensor the model needs at the right
shape (transformers' own loader, on the meta device: no tensor data is read).
With `[model.lora]`, the adapter is injected into a meta-device model as
training will inject it, so a target module the model lacks fails here.
With a sharding `train.sharding` (fsdp, hsdp), the decoder layers FSDP shards one unit each
must be found on a meta-device model (`parallel/fsdp/shard.py:decoder_layers`).
torch and transformers are imported by the checks that use them, so that
importing this module (through `validate` and `plan`) costs nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .config import RunConfig
from .errors import ConfigError
from .input_files import open_input, read_input_json_object
from .model_config import PATH_FIX, config_source, one_line, peft_lora_config, quiet_transformers, read_model_config

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

__all__ = ["WEIGHT_FILES", "check_model", "quiet_transformers", "read_model_config"]

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _check_weight_files(directory: Path, label: str) -> None:
    present = [name for name in WEIGHT_FILES if (directory / name).exists()]
    if not present:
        raise ConfigError(
            f"{label}: the directory has no weights ({', '.join(WEIGHT_FILES[:3])}); {PATH_FIX}, "
            "or use model.config to start from random weights"
        )
    for name in present:
        if name.endswith(".index.json"):
            index = read_input_json_object(directory / name, label, PATH_FIX)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConfigError(f"{directory / name}: has no 'weight_map'; re-save the model with save_pretrained")
            for shard in sorted(set(map(str, weight_map.values()))):
                if not (directory / shard).is_file():
                    raise ConfigError(
                        f"{directory / name}: names the shard {shard!r}, which is not in the directory; "
                        "copy the missing shard or re-save the model with save_pretrained"
                    )
    for file in sorted(directory.glob("*.safetensors")):
        _check_safetensors_header(file, label)


def _check_safetensors_header(file: Path, label: str) -> None:
    """Reading the header proves the file is complete (it records every tensor's byte range)."""
    from safetensors import safe_open

    open_input(file, label, PATH_FIX).close()  # a FIFO or an unreadable file fails by name
    try:
        with safe_open(str(file), "pt"):
            pass
    except Exception as error:  # noqa: BLE001 - safetensors raises its own SafetensorError
        raise ConfigError(
            f"{file}: not a complete safetensors file ({one_line(error)}); the copy is corrupt or "
            "truncated: copy it again or re-save the model"
        ) from None


def _check_pretrained_loads(config: RunConfig, label: str) -> None:
    """transformers' own loader, onto the meta device: every tensor present at the right shape."""
    from transformers import AutoModelForCausalLM

    path = config.model.path
    assert path is not None  # check_model calls this only for model.path
    try:
        # transformers types from_pretrained as returning the model alone; with output_loading_info=True it
        # returns (model, loading info).
        # use_kernels=False: transformers >= 5.2x defaults to its `kernels` hub layers, which refuse the meta
        # device ("Unsupported device type 'meta'") and would fetch kernels from the hub.
        _, info = AutoModelForCausalLM.from_pretrained(  # pyright: ignore[reportGeneralTypeIssues]
            path, local_files_only=True, device_map="meta", output_loading_info=True, use_kernels=False
        )
    except (OSError, RuntimeError, ValueError) as error:
        raise ConfigError(
            f"{label}: the weights do not load ({one_line(error)}); they do not match config.json: "
            f"re-save the model, or {PATH_FIX}"
        ) from None
    problems = sorted(info.get("missing_keys") or ()) + sorted(str(k) for k in info.get("mismatched_keys") or ())
    if problems:
        shown = ", ".join(problems[:3]) + (f" and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise ConfigError(
            f"{label}: the weights lack tensors the model needs ({shown}), which would start from "
            f"random values; use the weights that belong to this config.json, or {PATH_FIX}"
        )


def _check_forward(model_config: PretrainedConfig, file_label: str) -> None:
    """Build the model and run a short forward on the meta device: shapes only, no memory."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config)
            # use_cache=True whatever the config says: without a cache (and without a mask) transformers looks for
            # packed sequences in the position ids' values, which a meta tensor does not have. Shapes are the same.
            model(input_ids=torch.zeros(1, 8, dtype=torch.long), use_cache=True)
    except Exception as error:  # noqa: BLE001 - any failure here means the config describes no working model
        raise ConfigError(
            f"{file_label}: does not describe a working model ({type(error).__name__}: "
            f"{one_line(error)}); fix its sizes (e.g. num_attention_heads must be a multiple of "
            "num_key_value_heads)"
        ) from None


def _linear_names(model: torch.nn.Module) -> list[str]:
    import torch

    return sorted(
        {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    )


def _check_shardable(model_config: PretrainedConfig, file_label: str, sharding: str) -> None:
    """Find the decoder layers `shard_model` makes its units of, on a meta-device model, as the ranks will."""
    import torch
    from transformers import AutoModelForCausalLM

    from .parallel.fsdp.shard import decoder_layers

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    try:
        decoder_layers(model)
    except ValueError:
        names = sorted(set(getattr(model, "_no_split_modules", None) or ()))
        raise ConfigError(
            f'train.sharding = "{sharding}": {file_label} builds a {type(model).__name__}, whose decoder layers cannot be '
            f"found (no module class in _no_split_modules={names}, no model.model.layers); "
            'set train.sharding = "none", or train a model with decoder layers (e.g. Qwen3, Llama)'
        ) from None


def _check_lora(config: RunConfig, model_config: PretrainedConfig) -> None:
    """Inject the adapter into a meta-device copy, as training will: every target must name a module peft can adapt."""
    import torch
    from peft import inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    lora = config.model.lora
    assert lora is not None  # check_model calls this only when [model.lora] is set
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    linear = _linear_names(model)
    if isinstance(lora.target_modules, list):
        names = [name for name, _ in model.named_modules()]
        # peft's matching of a list entry: the module's full name, or its last dotted parts.
        missing = [t for t in lora.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
        if missing:
            raise ConfigError(
                f"model.lora.target_modules: {missing} match no module of this model; choose among its "
                f'linear layers {linear}, or use "all-linear"'
            )
    try:
        inject_adapter_in_model(peft_lora_config(config, lora), model, low_cpu_mem_usage=True)
    except (ValueError, TypeError, KeyError) as error:
        raise ConfigError(
            f"model.lora.target_modules={lora.target_modules!r} does not fit this model "
            f'({one_line(error)}); choose among its linear layers {linear}, or use "all-linear"'
        ) from None
    if lora.init_from is not None:
        _check_adapter_fits(lora.init_from, model)
    if config.model.pad_vocab_to_multiple_of is not None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        per_token = [m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
        if any(isinstance(m, BaseTunerLayer) for m in per_token):
            raise ConfigError(
                "model.lora.target_modules adapts the embedding or the output layer, whose rows "
                "model.pad_vocab_to_multiple_of pads; leave those layers out of target_modules, or unset "
                "model.pad_vocab_to_multiple_of"
            )


def _check_adapter_fits(init_from: str, model: torch.nn.Module) -> None:
    """The adapter a run continues holds exactly the tensors this run's adapter has (peft names it "default" here)."""
    from safetensors import SafetensorError

    from .training.lora_init import adapter_values

    shapes = {name: p.shape for name, p in model.named_parameters() if ".default." in name or name.endswith(".default")}
    try:
        adapter_values(Path(init_from), "default", shapes)
    except (ValueError, OSError, SafetensorError) as error:
        from .run.parent_record import parent_of

        parent = parent_of(init_from)  # continued from model.path = a committed LoRA checkpoint: name that
        problem = one_line(error)
        if parent is not None:
            problem = problem.replace(str(Path(init_from)) + "/", "")
        label = (
            f"model.path names the LoRA checkpoint {parent['url']}" if parent else f"model.lora.init_from={init_from!r}"
        )
        raise ConfigError(
            f"{label}: {problem}; continue it with the adapter's own "
            "target_modules (or remove them from [model.lora]: they are read from the adapter), or train a new "
            "adapter"
        ) from None


def check_model(config: RunConfig, tokenizer_vocab_size: int) -> PretrainedConfig:
    """Every check of the module docstring; returns the model's config."""
    model_config = read_model_config(config)
    file, label, _ = config_source(config)
    vocab_size = int(model_config.vocab_size)
    if vocab_size < tokenizer_vocab_size:
        raise ConfigError(
            f"{file}: vocab_size={vocab_size} is smaller than the tokenizer's {tokenizer_vocab_size} tokens "
            f"(tokenizer.path={config.tokenizer.path!r}); use a model whose vocab_size is at least "
            f"{tokenizer_vocab_size}, or the tokenizer that belongs to the model"
        )
    with quiet_transformers():
        _check_forward(model_config, str(file))
        if config.train.shards_weights:
            _check_shardable(model_config, str(file), config.train.sharding)
        if config.model.lora is not None:
            _check_lora(config, model_config)
        if config.model.path is not None:
            _check_weight_files(Path(config.model.path), label)
            _check_pretrained_loads(config, label)
    return model_config
