"""The run configuration: a TOML file validated into typed pydantic models.

One model per component, a docstring per field, and validation that names the
key and the fix. Prefect renders these models as the flow's parameter form, so
the same object travels from the CLI, the UI or a deployment to every stage.

Paths to inputs (model, tokenizer, data) are resolved against the directory of
the TOML file; paths to outputs (`run.work_dir`, a local `storage.url`) against
the current directory. `load_config` returns a config whose paths are absolute.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """Bad configuration: the message names the key and the fix."""


class _Section(BaseModel):
    # Unknown keys are errors: a typo must not silently fall back to a default.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunSection(_Section):
    name: str = Field("rankflow", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Run name; with the plan digest it forms the run id (`NAME-DIGEST12`)."""
    seed: int = 0
    """Seed for model initialisation, data order and every rank's RNG."""
    work_dir: str = ".rankflow"
    """Local scratch directory: plan shards, training states, staged exports, ledger."""


class ModelSection(_Section):
    path: str | None = None
    """A local Hugging Face model directory (config.json + weights) to fine-tune."""
    config: str | None = None
    """A Hugging Face config.json for a randomly initialised model (tests, examples)."""

    @model_validator(mode="after")
    def _exactly_one_source(self) -> "ModelSection":
        if (self.path is None) == (self.config is None):
            raise ValueError(
                "set exactly one of model.path (a local Hugging Face directory) "
                "or model.config (a config.json for a random-initialised model)"
            )
        return self


class TokenizerSection(_Section):
    path: str
    """A tokenizer directory (tokenizer.json, tokenizer_config.json) or a tokenizer.json file."""


class DataSection(_Section):
    path: str
    """JSONL file of conversations, one JSON object per line."""
    kind: Literal["sft", "rl"] = "sft"
    """Training objective: `sft` (loss on assistant tokens) or `rl` (clipped policy gradient on trajectories)."""
    max_seq_len: int = Field(512, ge=8)
    """Longest tokenized conversation; longer ones are handled by `overflow`."""
    overflow: Literal["error", "truncate", "drop"] = "error"
    """What to do with a conversation longer than max_seq_len (drops are counted)."""
    pack: bool = False
    """Pack several conversations per row of max_seq_len tokens, with attention kept within each."""
    advantage_normalization: Literal["mean_std", "mean"] = "mean_std"
    """RL rewards without advantages: group-relative advantages, (r - mean) / std or r - mean."""


class TrainSection(_Section):
    steps: int = Field(100, ge=1)
    """Total optimizer steps of the run."""
    steps_per_segment: int = Field(50, ge=1)
    """Optimizer steps per torchrun launch; training state is saved between segments."""
    global_batch_size: int = Field(16, ge=1)
    """Sequences per optimizer step, over all logical ranks."""
    learning_rate: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps, then a constant learning rate."""
    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value (0 disables clipping)."""
    logical_dp: int = Field(1, ge=1)
    """Logical data-parallel ranks; results do not depend on the physical world size."""
    nproc_per_node: int = Field(1, ge=1)
    """Physical ranks (torchrun processes); must divide logical_dp."""
    backward_mode: Literal["retain", "offload", "replay", "auto"] = "retain"
    """How each forward keeps its backward state; `auto` lets the memory planner choose per graph."""
    saved_bytes_budget: int | None = Field(None, ge=0)
    """Resident saved-tensor bytes the planner may keep (with backward_mode = auto)."""
    max_gradient_staleness: int = Field(2, ge=0)
    """Optimizer steps a forward's graph may lag behind at backward (0 = strict)."""
    segment_timeout_s: float = Field(1800, gt=0)
    """Wall-clock limit of one torchrun launch; past it the process group is killed."""

    @model_validator(mode="after")
    def _divisibility(self) -> "TrainSection":
        if self.logical_dp % self.nproc_per_node:
            raise ValueError(
                f"train.logical_dp={self.logical_dp} is not a multiple of "
                f"train.nproc_per_node={self.nproc_per_node}; choose a logical_dp "
                f"that the world size divides (e.g. {self.nproc_per_node * max(1, self.logical_dp // self.nproc_per_node)})"
            )
        if self.global_batch_size % self.logical_dp:
            raise ValueError(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                f"train.logical_dp={self.logical_dp}; every logical rank needs the same "
                f"number of sequences (e.g. global_batch_size="
                f"{self.logical_dp * max(1, self.global_batch_size // self.logical_dp)})"
            )
        return self

    @property
    def num_segments(self) -> int:
        return -(-self.steps // self.steps_per_segment)


class RLSection(_Section):
    clip_low: float = Field(0.2, ge=0, lt=1)
    """Lower clip of the importance ratio: r >= 1 - clip_low."""
    clip_high: float = Field(0.28, ge=0)
    """Upper clip of the importance ratio: r <= 1 + clip_high."""
    sft_coef: float = Field(0.0, ge=0)
    """Weight of an SFT term on the same loss tokens, added to the policy-gradient loss."""
    initial_policy_version: int = Field(0, ge=0)
    """Policy version of the initial weights; each optimizer step adds one."""
    max_data_staleness: int | None = Field(None, ge=0)
    """Trajectories generated more than this many policy versions ago are dropped or rejected (None: no bound)."""
    stale_trajectories: Literal["drop", "error"] = "drop"
    """What to do with a trajectory past max_data_staleness (drops are counted)."""


class ExportSection(_Section):
    every_n_segments: int = Field(0, ge=0)
    """Also export after every N segments (0: only at the end, which always happens)."""
    max_shard_size: str = "2GB"
    """Safetensors shard size limit, as transformers' `save_pretrained` takes it."""


class StorageSection(_Section):
    url: str = ".rankflow/store"
    """Where checkpoints are committed: a local path, `file://…` or `s3://bucket/prefix`."""
    timeout_s: float = Field(1800, gt=0)
    """Overall time limit of one commit, cleanup or ledger upload; past it the stage fails, retriably."""
    request_timeout_s: float = Field(60, gt=0)
    """Connect and read timeout of one S3 request: a stopped server fails it instead of hanging."""

    @property
    def is_s3(self) -> bool:
        return self.url.startswith("s3://")


class RunConfig(_Section):
    """The whole run: one section per component."""

    run: RunSection = RunSection()
    model: ModelSection
    tokenizer: TokenizerSection
    data: DataSection
    train: TrainSection = TrainSection()
    rl: RLSection = RLSection()
    export: ExportSection = ExportSection()
    storage: StorageSection = StorageSection()

    def export_after_segment(self, segment_index: int) -> bool:
        """Whether a checkpoint is exported after segment `segment_index` (0-based)."""
        last = segment_index == self.train.num_segments - 1
        every = self.export.every_n_segments
        return last or (every > 0 and (segment_index + 1) % every == 0)


def _set_dotted(tree: dict[str, Any], dotted: str, raw_value: str) -> None:
    """Apply one `--set a.b=value` override; the value is parsed as TOML when it can be."""
    keys = dotted.split(".")
    if not all(keys):
        raise ConfigError(f"--set {dotted}=…: empty key segment; write it as section.key=value")
    try:
        value = tomllib.loads(f"v = {raw_value}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw_value  # a bare string such as a path or a name
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: '{key}' is a value, not a section")
        node = child
    node[keys[-1]] = value


def _format_validation_error(error: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown key; check its spelling against the README's config reference"
        elif item["type"] == "missing":
            message = "required key is missing; add it to the config"
        elif "input" in item and item["type"] not in ("value_error",):
            message = f"{message} (got {item['input']!r})"
        lines.append(f"  {key}: {message.removeprefix('Value error, ')}")
    return "\n".join(lines)


def _resolve_paths(config: RunConfig, config_dir: Path) -> RunConfig:
    def inp(value: str) -> str:
        return str((config_dir / Path(value).expanduser()).resolve())

    def out(value: str) -> str:
        return str(Path(value).expanduser().resolve())

    if config.model.path is not None:
        config.model.path = inp(config.model.path)
    if config.model.config is not None:
        config.model.config = inp(config.model.config)
    config.tokenizer.path = inp(config.tokenizer.path)
    config.data.path = inp(config.data.path)
    config.run.work_dir = out(config.run.work_dir)
    url = config.storage.url
    if url.startswith("file://"):
        url = url.removeprefix("file://")
    if "://" not in url:
        config.storage.url = out(url)
    elif not url.startswith("s3://"):
        raise ConfigError(
            f"storage.url={url!r}: unsupported scheme; use a local path, file://PATH or s3://BUCKET/PREFIX"
        )
    return config


def _check_inputs_exist(config: RunConfig) -> None:
    checks = [
        ("model.path", config.model.path, "a local Hugging Face model directory"),
        ("model.config", config.model.config, "a config.json file"),
        ("tokenizer.path", config.tokenizer.path, "tokenizer.json or a tokenizer directory"),
        ("data.path", config.data.path, "a JSONL file of conversations"),
    ]
    for key, value, what in checks:
        if value is not None and not Path(value).exists():
            raise ConfigError(f"{key}={value!r} does not exist; point it at {what}")


_RUN_DIR_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*-[0-9a-f]{12}$")
"""A run directory under run.work_dir is named after the run id, NAME-DIGEST12."""


def check_locations_disjoint(work_dir: str, storage_url: str) -> None:
    """Refuse a local store and a work directory that overlap (the one place this is checked).

    Cleanup deletes staged exports in each run directory under the work
    directory, and the ledger and plan live there under the run id too; a store
    in the same place (or in a run directory, or in the data cache, or around
    the work directory) would have committed checkpoints deleted or
    overwritten. A store in its own subdirectory of the work directory (the
    default `.rankflow/store`) is fine.
    """
    if "://" in storage_url and not storage_url.startswith("file://"):
        return  # an object store cannot overlap a local directory
    store = Path(storage_url.removeprefix("file://")).expanduser().resolve()
    work = Path(work_dir).expanduser().resolve()
    if store == work:
        problem = "are the same directory"
    elif work.is_relative_to(store):
        problem = "overlap: the work directory lies inside the store"
    elif store.is_relative_to(work) and (_RUN_DIR_NAME.match(first := store.relative_to(work).parts[0])
                                          or first == "cache"):
        problem = (f"overlap: the store lies inside {work / first}, which rankflow rewrites and deletes "
                   "(a run directory with its staged exports, or the data cache)")
    else:
        return
    raise ConfigError(f"storage.url={str(store)!r} and run.work_dir={str(work)!r} {problem}; point them at "
                      "separate directories, e.g. storage.url = \".rankflow/store\" with run.work_dir = \".rankflow\"")


def config_from_dict(tree: dict[str, Any], *, config_dir: Path, source: str = "(dict)") -> RunConfig:
    """Validate a config tree, resolve its paths and check that its inputs exist."""
    try:
        config = RunConfig.model_validate(tree)
    except ValidationError as error:
        raise ConfigError(_format_validation_error(error, source)) from None
    config = _resolve_paths(config, config_dir)
    _check_inputs_exist(config)
    check_locations_disjoint(config.run.work_dir, config.storage.url)
    return config


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a TOML config, apply `dotted.key=value` overrides and validate it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass the path of a TOML config")
    try:
        tree = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {path}: not valid TOML: {error}") from None
    for override in overrides:
        dotted, sep, raw_value = override.partition("=")
        if not sep:
            raise ConfigError(f"--set {override!r}: expected dotted.key=value")
        _set_dotted(tree, dotted.strip(), raw_value.strip())
    return config_from_dict(tree, config_dir=path.resolve().parent, source=str(path))
