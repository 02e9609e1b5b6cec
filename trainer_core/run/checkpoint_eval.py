"""The eval loss of a checkpoint directory on data files, in one process: what `rankflow eval` computes.

    result = evaluate_checkpoint(directory, open_source(paths, key="--data"), EvalSettings(), scratch=DIR)

The same quantity as the eval loss a run records during training (`trainer_core.run.evaluation`, whose
`evaluate` does the forwards here too): the data go through the data stages with the checkpoint's own tokenizer
and chat template (`data.format`'s formats, every bad record a DataError naming FILE:LINE), each conversation is
one unpacked row (`trainer_core.run.held_out`'s layout: shortest first, so a forward's rows need little padding),
and the loss is the SFT loss, minus the log-probability of each assistant token, summed in float64 and divided by
the number of those tokens. RL trajectories are refused: a run's RL eval loss is its objective's, which needs the
behaviour policy, and no checkpoint alone gives it.

What a checkpoint directory holds (`checkpoint_layout.py`): a full model (config.json + safetensors), loaded in
the dtype it was saved in; or a LoRA adapter (adapter_config.json), applied with peft over the base its config
names, `base/` inside the checkpoint or a model directory on this machine. The whole model is in this process's
memory, on `EvalSettings.device`.

The rows are laid out `CHUNK_CONVERSATIONS` at a time (in the global shortest-first order), so the memory for
the rows is bounded by a chunk whatever the number of conversations; the data stages keep the tokens in a store
under `scratch`, never all in memory.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from trainer_core.data import DataError, DataOptions, DataSource, load_chat_template, load_tokenizer
from trainer_core.data.shards import stack_rows, unpacked_steps
from trainer_core.data.streaming import fit_store, stage_source
from trainer_core.data_kinds import SFT_DATA
from trainer_core.errors import ConfigError
from trainer_core.model_config import quiet_transformers
from trainer_core.objectives import SFT
from trainer_core.ranks import LogicalDataParallel, Topology
from trainer_core.run.evaluation import evaluate
from trainer_core.training import Trainer

MAX_SEQ_LEN_CAP = 8192
"""The default `max_seq_len` is the model's positions, at most this: a longer row costs its activations in one
forward (`batch_rows` × length), and a real eval file rarely needs more."""
CHUNK_CONVERSATIONS = 1024
"""Conversations laid out as rows at a time, rounded down to a multiple of `batch_rows`: every forward is the one a
layout of all the rows at once would run."""
ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True, kw_only=True)
class EvalSettings:
    """How `rankflow eval` reads the data and runs the model; each field is one of its options."""

    max_seq_len: int | None = None
    """`--max-seq-len`: tokens a conversation keeps; a longer one is truncated to its first `max_seq_len` tokens
    (counted; one left without an assistant token is dropped, counted). None: the model's `max_position_embeddings`
    rounded down to a multiple of 8, at most `MAX_SEQ_LEN_CAP`."""
    batch_rows: int = 8
    """`--batch-rows`: conversations per forward, as `train.rows_per_forward` (its activation memory)."""
    device: str | None = None
    """`--device`: where the model runs (`cpu`, `cuda`, `cuda:1`); None: `cuda` when there is one, else `cpu`."""

    def __post_init__(self) -> None:
        if self.max_seq_len is not None and self.max_seq_len < 8:
            raise ConfigError(f"--max-seq-len {self.max_seq_len}: a conversation needs room; give at least 8")
        if self.batch_rows < 1:
            raise ConfigError(f"--batch-rows {self.batch_rows}: a forward runs at least one row; give 1 or more")
        self.torch_device()  # a device this machine does not have is bad input, found before any download

    def torch_device(self) -> torch.device:
        """`device` as torch names it, checked: cpu, or a CUDA device this machine has."""
        if self.device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise ConfigError(
                f"--device {self.device!r} is not a device rankflow eval runs on; give cpu, cuda or cuda:N"
            )
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.type == "cuda" and (device.index or 0) >= count:
            raise ConfigError(
                f"--device {self.device}: this machine has {count} CUDA device(s); give cpu, or one it has"
            )
        return device


@dataclass(frozen=True)
class CheckpointEval:
    """The result: the eval loss and what it was computed over."""

    eval_loss: float
    """Mean loss per loss token (minus the log-probability of each assistant token)."""
    num_conversations: int
    """Conversations evaluated (after the length limit)."""
    num_records: int
    num_loss_tokens: int
    num_tokens: int
    """Tokens of the evaluated conversations (after truncation)."""
    num_truncated: int
    num_dropped: int
    """Left without an assistant token by truncation."""
    max_seq_len: int
    kind: Literal["full", "lora"]
    dtype: str
    device: str
    eval_s: float
    """Seconds of the forwards (model loaded, data staged)."""

    def to_dict(self) -> dict:
        return {
            "eval_loss": self.eval_loss,
            "conversations": self.num_conversations,
            "records": self.num_records,
            "loss_tokens": self.num_loss_tokens,
            "tokens": self.num_tokens,
            "truncated": self.num_truncated,
            "dropped": self.num_dropped,
            "max_seq_len": self.max_seq_len,
            "kind": self.kind,
            "dtype": self.dtype,
            "device": self.device,
            "eval_s": round(self.eval_s, 3),
        }


@dataclass(frozen=True)
class _ModelFiles:
    """Where a checkpoint's weights are: the model directory (the base, for an adapter), the adapter's or None."""

    model_dir: Path
    adapter_dir: Path | None


def _model_files(directory: Path, label: str) -> _ModelFiles:
    if (directory / "config.json").is_file():
        return _ModelFiles(directory, None)
    if not (directory / ADAPTER_CONFIG).is_file():
        raise ConfigError(
            f"{label}: the checkpoint holds neither config.json (a full model) nor {ADAPTER_CONFIG} (a LoRA "
            "adapter); name a checkpoint rankflow committed"
        )
    named = json.loads((directory / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or ""
    # A model.config run ships its base in the checkpoint, named relative to it; a model.path run names that path.
    for base in (directory / named, Path(named)):
        if named and (base / "config.json").is_file():
            return _ModelFiles(base, directory)
    raise ConfigError(
        f"{label}: a LoRA adapter over the base model {named!r}, which is neither in the checkpoint nor a model "
        "directory on this machine; put that base model there, or evaluate a run exported with export.merge_lora "
        "(its merged/ directory is a full model)"
    )


def default_max_seq_len(max_positions: int | None) -> int:
    """The model's positions rounded down to a multiple of 8 (a row is padded to one), at most MAX_SEQ_LEN_CAP."""
    return MAX_SEQ_LEN_CAP if not max_positions else min(MAX_SEQ_LEN_CAP, max_positions - max_positions % 8)


def _max_seq_len(settings: EvalSettings, model_dir: Path) -> int:
    from transformers import AutoConfig

    with quiet_transformers():
        positions = getattr(
            AutoConfig.from_pretrained(str(model_dir), local_files_only=True), "max_position_embeddings", None
        )
    if settings.max_seq_len is None:
        return default_max_seq_len(positions)
    if positions and settings.max_seq_len > positions - positions % 8:
        raise ConfigError(
            f"--max-seq-len {settings.max_seq_len}: more positions than the model's max_position_embeddings="
            f"{positions}; give at most {positions - positions % 8} (or leave it out: that is the default)"
        )
    return settings.max_seq_len


def _load_model(files: _ModelFiles, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with quiet_transformers():
        # dtype="auto": the dtype the weights were saved in (the run's train.dtype). use_kernels=False: transformers'
        # own modules, as the trainer runs them (a `kernels` hub layer would be downloaded).
        model = AutoModelForCausalLM.from_pretrained(
            str(files.model_dir), local_files_only=True, dtype="auto", use_kernels=False
        )
        if files.adapter_dir is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(files.adapter_dir))
    return model.to(device)  # pyright: ignore[reportArgumentType] - transformers types `to` through its mixins


def _stage(source: DataSource, directory: Path, settings: EvalSettings, max_seq_len: int, scratch: Path):
    """The data through the stages with the checkpoint's tokenizer and template: (store, prepared)."""
    tokenizer = load_tokenizer(directory)
    template = load_chat_template(directory)
    store = stage_source(source, tokenizer, template, DataOptions().advantage_normalization, scratch)
    try:
        if store.kind is not SFT_DATA:
            raise DataError(
                f"{source.label}: the records are RL trajectories (rewards, logprobs); rankflow eval computes the "
                "SFT loss of conversations: drop the RL fields, or read an RL run's eval loss from its summary"
            )
        options = DataOptions(max_seq_len=max_seq_len, overflow="truncate")
        return store, fit_store(store, source, options)
    except BaseException:
        store.close()
        raise


def _chunks(lengths: np.ndarray, size: int) -> list[np.ndarray]:
    """Document indices shortest first (the eval shard's order), `size` at a time."""
    order = np.argsort(lengths, kind="stable")
    return [order[start : start + size] for start in range(0, len(order), size)]


def _rows(documents: Sequence, indices: np.ndarray, pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    (rows,) = unpacked_steps(documents, indices[None, :], pad_id)
    return {name: tensor[0].to(device) for name, tensor in stack_rows([rows], packed=False).items()}


def evaluate_checkpoint(
    directory: Path, source: DataSource, settings: EvalSettings, *, scratch: Path, label: str | None = None
) -> CheckpointEval:
    """The eval loss of the checkpoint in `directory` on the data of `source` (see the module docstring).

    Writes only the data stages' store, under `scratch` (an empty or new directory the caller removes). Bad input
    (a data file, a record, a setting, a checkpoint that is not a model) raises a BadInputError naming it; `label`
    names the checkpoint in messages (default: the directory).
    """
    label = label or str(directory)
    files = _model_files(directory, label)
    max_seq_len = _max_seq_len(settings, files.model_dir)
    device = settings.torch_device()
    store, prepared = _stage(source, directory, settings, max_seq_len, scratch)  # bad data costs no model load
    try:
        model = _load_model(files, device)
        started = time.perf_counter()
        loss_sum, loss_tokens = _loss_sum(model, prepared.documents, prepared.lengths, settings.batch_rows, device)
        eval_s = time.perf_counter() - started
        dtype = next(model.parameters()).dtype
    finally:
        store.close()
    return CheckpointEval(
        eval_loss=loss_sum / loss_tokens if loss_tokens else float("nan"),
        num_conversations=len(prepared.lengths),
        num_records=prepared.num_records,
        num_loss_tokens=loss_tokens,
        num_tokens=int(prepared.lengths.sum()),
        num_truncated=prepared.num_truncated,
        num_dropped=prepared.num_dropped,
        max_seq_len=max_seq_len,
        kind="full" if files.adapter_dir is None else "lora",
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        eval_s=eval_s,
    )


def _loss_sum(
    model: torch.nn.Module, documents: Sequence, lengths: np.ndarray, batch_rows: int, device: torch.device
) -> tuple[float, int]:
    """(loss sum in float64, loss tokens) over every document: `evaluate` over one process and one logical rank,
    chunk by chunk."""
    trainer = Trainer(model)
    ldp = LogicalDataParallel(trainer, Topology(rank=0, world_size=1, logical_dp=1))
    # Padding is masked out of attention and carries no loss: its id changes no result.
    pad_id = getattr(getattr(model, "config", None), "pad_token_id", None) or 0
    total, total_tokens = 0.0, 0
    chunk_size = max(batch_rows, CHUNK_CONVERSATIONS - CHUNK_CONVERSATIONS % batch_rows)
    for indices in _chunks(lengths, chunk_size):
        rows = _rows(documents, indices, pad_id, device)
        loss_tokens = int(rows["loss_mask"][:, 1:].sum())
        mean = evaluate(trainer, ldp, SFT(), rows, revision=0, rows_per_forward=batch_rows, loss_tokens=loss_tokens)
        total += mean * loss_tokens if loss_tokens else 0.0
        total_tokens += loss_tokens
    return total, total_tokens
