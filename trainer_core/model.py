"""Build the Hugging Face causal LM a run trains (from a local directory or a config), and its Trainer.

Nothing is downloaded here: `model.path` is a local directory (a hub model id
was resolved to its snapshot in the Hugging Face cache before planning,
`model_source`), `model.config` a config.json for a randomly initialised
model (tests and examples). `model.attn_implementation`, when set, is the
attention kernel transformers builds the model with.

What the trainer trains follows the config:

- full fine-tuning: one checkpoint, `base`, owning every weight;
- `[model.lora]`: one checkpoint, `lora`, a peft adapter on the frozen base.
  The base is fixed by `model.path` (or `model.config` + `run.seed`), so the
  training state holds only the adapter and its AdamW state;
- `train.dtype = "bfloat16"`: the weights (and so activations and saved
  tensors) are bf16, and the trainer steps FP32 master weights with FP32
  moments (`training/checkpoints.py`). Masters rather than autocast: autocast
  keeps FP32 weights and re-casts them every forward, saving no weight
  memory; masters halve the weights and the saved tensors the memory planner
  budgets, while an update far below bf16's resolution still accumulates;
- `model.pad_vocab_to_multiple_of`: zero padding rows, outputs over the true
  vocabulary (`training/vocab.py`);
- `train.activation_checkpointing = "blocks"`: every decoder layer keeps only
  its input and recomputes in backward (`training/activation_checkpointing.py`);
  parameter names and so saved states and exports are those of `"none"`;
- `train.sharding = "fsdp"` (or `"hsdp"`: the same units over a (nodes,
  processes per node) mesh, `parallel/hsdp.py`; the registry's parallelism
  wraps the model): the model is built as the unsharded run builds
  it, its parameters upcast to FP32, and FSDP2-sharded over the mesh the
  caller passes (`parallel/fsdp/shard.py`); with `train.dtype = "bfloat16"`
  the FP32 shards are the masters and bf16 is the all-gather and compute
  dtype (FSDP's `MixedPrecisionPolicy`), so no second copy of the weights
  exists, and the masters are bitwise a replica's (its bf16 weights upcast).
  A `model.path` run is loaded straight into shards on the meta device, each
  rank reading its own rows (`parallel/fsdp/load.py`), rounded through
  bf16 the same way, activation checkpointing and the adapter applied on
  meta: bitwise what from_pretrained then `shard_model` give. With
  `[model.lora]` the adapter is injected before sharding (build → inject →
  shard → register): its parameters are shards of their layers' units,
  drawn from the same seeded RNG as the unsharded run's (and rounded through
  bf16 under `train.dtype = "bfloat16"`, as that run builds it), over the
  frozen sharded base.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoModelForCausalLM, PreTrainedModel

from .config import RunConfig
from .model_config import peft_lora_config, read_model_config
from .parallel import PARALLELISMS, Parallelism
from .parallel.fsdp.load import load_sharded
from .parallel.fsdp.shard import ShardedModel
from .training import MemoryPlanner, MissReports, OptimizerConfig, StalenessPolicy, Trainer, pad_vocabulary
from .training.activation_checkpointing import checkpoint_blocks
from .training.lora_init import adapter_values
from .training.lora_injection import inject_lora, inject_lora_on_meta

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BASE_CHECKPOINT = "base"
LORA_CHECKPOINT = "lora"


def build_dtype(config: RunConfig) -> torch.dtype:
    """The dtype the model's parameters are built in: `train.dtype`, or FP32 under fsdp (the shards are the masters)."""
    return torch.float32 if config.train.shards_weights else DTYPES[config.train.dtype]


def _no_init_weights():
    """transformers' context that skips weight initialisation (moved between major versions)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights  # pyright: ignore[reportAttributeAccessIssue]
    return no_init_weights()


def build_model(config: RunConfig, *, weights_from_state: bool = False) -> tuple[PreTrainedModel, int | None]:
    """The initial model in `build_dtype`, and its true vocabulary size when its rows were padded (else None).

    `weights_from_state`: every weight will be overwritten by a saved state (a resumed full fine-tune), so a
    model built from a config skips its random initialisation, which costs about 1.3 s per GB of state on a
    CPU core (15 ms per million parameters) and whose values the restore replaces anyway. Buffers (RoPE's
    `inv_freq`) are computed by the modules themselves, as in any build.

    Under fsdp with a bf16 `train.dtype` the model is built in bf16, exactly as the unsharded run builds it, and
    its parameters are then upcast to FP32: the FP32 shards are the masters, and a replica's masters are its bf16
    weights upcast, so both runs start from bitwise the same masters (from an FP32 checkpoint too, which both
    round through bf16; buffers stay as built, RoPE's `inv_freq` FP32).
    """
    dtype = DTYPES[config.train.dtype]
    if config.model.path is not None:
        # use_kernels=False: the model trains as transformers' own modules (a `kernels` hub layer would be
        # downloaded, and would differ from the model built from a config).
        model = AutoModelForCausalLM.from_pretrained(
            config.model.path, local_files_only=True, dtype=dtype, use_kernels=False, **_attention(config)
        )
    else:
        # The same seed on every rank gives every rank the same initial weights
        # without a broadcast.
        with torch.random.fork_rng(devices=[]), _no_init_weights() if weights_from_state else contextlib.nullcontext():
            torch.manual_seed(config.run.seed)
            model = AutoModelForCausalLM.from_config(read_model_config(config), dtype=dtype, **_attention(config))
        if weights_from_state:
            model.tie_weights()  # skipped with the initialisation: tied embeddings would be two parameters
    # The config stays as the base has it (use_cache included): it is what the export writes, and the trainer's
    # forwards ask for no KV cache themselves (training/outputs.py).
    true_vocab = None
    if config.model.pad_vocab_to_multiple_of is not None:
        true_vocab = pad_vocabulary(model, config.model.pad_vocab_to_multiple_of)
    if config.train.shards_weights:
        _upcast_parameters(model, build_dtype(config))
    if config.train.activation_checkpointing == "blocks":
        checkpoint_blocks(model)
    return model, true_vocab


def _attention(config: RunConfig) -> dict[str, str]:
    """transformers' `attn_implementation` where `model.attn_implementation` sets one (unset: its own choice)."""
    kernel = config.model.attn_implementation
    return {} if kernel is None else {"attn_implementation": kernel}


def _upcast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating parameter in `dtype` (tied ones stay one parameter); buffers are left as built."""
    upcast: dict[int, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}  # id -> (old, new): old kept alive
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_floating_point() or param.dtype == dtype:
                continue
            if id(param) not in upcast:
                upcast[id(param)] = (param, torch.nn.Parameter(param.detach().to(dtype), param.requires_grad))
            module._parameters[name] = upcast[id(param)][1]


def _compute_dtype(config: RunConfig) -> torch.dtype | None:
    """FSDP's all-gather and compute dtype: `train.dtype`, None for FP32 (the shards' own)."""
    return DTYPES[config.train.dtype] if config.train.dtype != "float32" else None


def _load_sharded(config: RunConfig, mesh: DeviceMesh, lora) -> tuple[ShardedModel, int | None]:
    """`model.path` under fsdp: built on meta, each rank reading its own rows (`fsdp.load`); the true vocabulary.

    Bitwise the model `build_model` then `shard_model` give: activation checkpointing and the LoRA adapter are
    applied on meta, and the adapter's initial weights are peft's own draws at the seed, as unsharded.
    """
    assert config.model.path is not None

    def prepare(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        if config.train.activation_checkpointing == "blocks":
            checkpoint_blocks(model)
        if lora is None:
            return {}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.run.seed)
            return inject_lora_on_meta(model, LORA_CHECKPOINT, lora, round_to=_compute_dtype(config))

    sharding, report = load_sharded(
        Path(config.model.path),
        mesh,
        dtype=build_dtype(config),
        param_dtype=_compute_dtype(config),
        round_through=_compute_dtype(config),  # the unsharded run's weights are the file's values in train.dtype
        attn_implementation=config.model.attn_implementation,
        pad_vocab_to_multiple_of=config.model.pad_vocab_to_multiple_of,
        prepare=prepare,
    )
    return sharding, report.true_vocab


def build_trainer(
    config: RunConfig,
    *,
    miss_reports: MissReports | None = None,
    mesh: DeviceMesh | None = None,
    weights_from_state: bool = False,
) -> Trainer:
    """The model of `config` in a Trainer with its checkpoint, as segments and exports use it.

    `miss_reports` receives the memory planner's miss reports (a segment passes one under the run directory).
    `mesh`: the training processes' mesh, required under `train.sharding = "fsdp"` (collective: every rank calls).
    `weights_from_state`: the caller restores a saved state next; a full fine-tune then skips the weights'
    random initialisation (`build_model`), since its one checkpoint owns, and the restore writes, every weight.
    """
    train = config.train
    spread = PARALLELISMS[train.sharding]
    parallelism: Parallelism | None = None  # None: the Trainer's default, Replicated
    lora = None if config.model.lora is None else peft_lora_config(config, config.model.lora)
    # A LoRA run's base is not in its state: it keeps its initialisation.
    weights_from_state = weights_from_state and lora is None
    if not train.shards_weights:
        model, true_vocab = build_model(config, weights_from_state=weights_from_state)
    elif mesh is None:
        raise ValueError(f'train.sharding = "{train.sharding}" needs the mesh of the training processes (mesh=)')
    elif config.model.path is not None:
        sharded, true_vocab = _load_sharded(config, mesh, lora)
        parallelism = spread(sharded)  # type: ignore[call-arg]  # a sharding parallelism takes the loaded units
        model = sharded.model
    else:
        model, true_vocab = build_model(config, weights_from_state=weights_from_state)
        if lora is not None:
            # Before the parallelism wraps the model, so a sharded one makes the adapter's parameters shards of their
            # layers' units; drawn as the unsharded run draws it (the same seed; rounded to the dtype that run builds
            # the adapter in).
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(config.run.seed)
                inject_lora(model, LORA_CHECKPOINT, lora, round_to=_compute_dtype(config))
        parallelism = spread.wrap(model, mesh, param_dtype=_compute_dtype(config))
    trainer = Trainer(
        model,
        parallelism=parallelism,
        staleness=StalenessPolicy(max_gradient_staleness=train.max_gradient_staleness),
        planner=MemoryPlanner(
            budget_bytes=train.saved_bytes_budget,
            miss_threshold=train.planner_miss_threshold,
            miss_reports=miss_reports,
        ),
        # Non-finite gradients reach the step, whose norm every rank agrees on;
        # the segment runner applies train.nonfinite to the step's report.
        nonfinite="skip",
        vocab_size=true_vocab,
    )
    optimizer = OptimizerConfig(
        learning_rate=train.learning_rate,
        betas=train.betas,
        eps=train.eps,
        weight_decay=train.weight_decay,
        grad_clip=train.grad_clip,
        schedule=train.schedule,
    )
    if lora is None:
        base = trainer.add_base_checkpoint(BASE_CHECKPOINT, optimizer=optimizer)
        if weights_from_state:  # a weight the restore would not write must not keep uninitialised memory
            owned = {id(p) for p in base.parameters().values()}
            if unowned := [n for n, p in model.named_parameters() if id(p) not in owned]:
                raise RuntimeError(f"weights {unowned[:4]} are in no checkpoint; build without weights_from_state")
    elif trainer.parallelism.adopts_injected_adapters:
        trainer.add_lora_checkpoint(LORA_CHECKPOINT, lora, optimizer=optimizer)  # adopts the injected adapter
    else:
        # peft draws the adapter's initial A matrices from the global RNG: seed it, so every rank agrees.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.run.seed)
            trainer.add_lora_checkpoint(LORA_CHECKPOINT, lora, optimizer=optimizer)
        assert config.model.lora is not None
        if config.model.lora.init_from is not None:  # a committed adapter continues (a fresh optimizer)
            checkpoint = trainer.checkpoints[LORA_CHECKPOINT]
            shapes = {name: param.shape for name, param in checkpoint.parameters().items()}
            checkpoint.replace(adapter_values(Path(config.model.lora.init_from), LORA_CHECKPOINT, shapes))
    return trainer
