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
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from .config_base import _INT64_MAX, _Section
from .config_messages import describe_validation_error
from .config_train import TrainSection
from .data_kinds import DATA_KINDS
from .data_sources import data_files, entries, resolve_entry
from .errors import ConfigError
from .hub_ids import is_hub_id
from .input_files import resolved_path
from .parallel.limits import PARALLELISM_LIMITS  # torch-free, like the names
from .registry_names import NO_TRACKING, OBJECTIVE_NEEDS, TRACKING_BACKENDS
from .storage_url import check_storage_url, local_path, overlap

__all__ = ["ConfigError", "RunConfig", "config_from_dict", "load_config"]


class RunSection(_Section):
    name: str = Field(default="rankflow", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Run name; with the plan digest it forms the run id (`NAME-DIGEST12`)."""
    seed: int = Field(default=0, ge=0, le=_INT64_MAX)
    """Seed for model initialisation, data order and every rank's RNG."""
    work_dir: str = ".rankflow"
    """Local cache of the run's state (the store holds it; deletable at any time), staged exports, logs and the
    ledger."""
    lease_wait_s: float = Field(default=0, ge=0)
    """How long a run waits for another run of the same run id to finish (its run lease) before giving up (exit 75)."""
    lease_ttl_s: float = Field(default=60, ge=1)
    """Seconds a run's lease outlives its last heartbeat (every ttl/3): the longest a crashed run on another machine
    blocks the next."""


class LoraSection(_Section):
    """`[model.lora]`: train a peft LoRA adapter on the frozen base model instead of the full model."""

    rank: int = Field(default=8, ge=1, le=4096)
    """The adapter's rank r (peft's `r`)."""
    alpha: float = Field(default=16.0, gt=0)
    """The scaling numerator: the adapter's update is scaled by alpha / rank (peft's `lora_alpha`)."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapter's input (peft's `lora_dropout`)."""
    target_modules: list[str] | str = "all-linear"
    """Module names (or suffixes) to adapt, e.g. ["q_proj", "v_proj"]; "all-linear": every linear layer but the output.
    The pre-flight checks that each name matches a module of the model."""
    init_from: str | None = None
    """A peft adapter directory (adapter_model.safetensors) whose weights the adapter starts from instead of peft's
    initialisation, with a fresh optimizer; set for you when model.path names a committed LoRA checkpoint (its
    adapter continues, on its base). Its rank, alpha and modules must be this section's."""

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, value: list[str] | str) -> list[str] | str:
        fix = 'list module names such as ["q_proj", "v_proj"], or write "all-linear"'
        if isinstance(value, str) and value != "all-linear":
            raise ValueError(f'{value!r} is neither a list of module names nor "all-linear"; {fix}')
        if isinstance(value, list) and (not value or not all(name.strip() for name in value)):
            raise ValueError(f"target_modules {value!r} is empty or holds an empty name; {fix}")
        return value


CHECKPOINT_REFERENCE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*@(latest|step-\d+)$")
"""`RUN@latest` or `RUN@step-N`: a checkpoint committed in this run's store (infra/publication/parent.py)."""


def names_stored_checkpoint(path: str) -> bool:
    """Whether a model.path is fetched from a store (a URL, or `RUN@latest`) rather than read where it is."""
    return "://" in path or CHECKPOINT_REFERENCE.match(path) is not None


def _names_fetched_model(path: str, config_dir: Path) -> bool:
    """Whether a model.path as written is fetched before planning (a committed checkpoint, or a hub model id with no
    such directory beside the config) rather than read where it is."""
    if names_stored_checkpoint(path):
        return True
    return is_hub_id(path) and not (config_dir / path).exists()


class ModelSection(_Section):
    path: str | None = None
    """A local Hugging Face model directory (config.json + weights) to fine-tune; a hub model id (`Qwen/Qwen3-8B`,
    when no such directory is beside the config), read through the Hugging Face cache and downloaded there when
    online (trainer_core/model_source.py); or a checkpoint rankflow committed: its URL (`s3://…/RUN/checkpoints/step-N`,
    or the local store's path to it) or `RUN@latest` / `RUN@step-N` in this run's store, verified and fetched before
    planning. Set exactly one of model.path and model.config."""
    revision: str | None = None
    """With a hub model id in model.path: the branch, tag or commit to read (unset: main). Set for you to the commit
    it resolved to: the run id names that commit, so a branch that moves on starts another run."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] | None = None
    """The attention kernel transformers runs (its `attn_implementation`): `sdpa`, `eager`, or `flash_attention_2`
    (needs the flash-attn package and a GPU). Unset: transformers' own choice (sdpa where the model has it). In the run
    id only when set, since kernels differ in their last bits."""
    config: str | None = None
    """A Hugging Face config.json for a randomly initialised model (tests, examples); set exactly one of model.path and
    model.config."""
    lora: LoraSection | None = None
    """Train a LoRA adapter (`[model.lora]`) instead of every weight; the base stays frozen and is not re-saved."""
    pad_vocab_to_multiple_of: int | None = Field(default=None, ge=1, le=65536)
    """Pad the embedding and output rows to a multiple of this (e.g. 64) for kernels or sharding; exports, gradients
    and optimizer updates never see the padding."""

    @model_validator(mode="after")
    def _exactly_one_source(self) -> "ModelSection":
        if (self.path is None) == (self.config is None):
            raise ValueError(
                "set exactly one of model.path (a local Hugging Face directory) "
                "or model.config (a config.json for a random-initialised model)"
            )
        if self.revision is not None and self.path is None:
            raise ValueError(
                f"model.revision={self.revision!r} applies to a hub model id in model.path, and model.path is not "
                "set; set model.path to the hub id (e.g. Qwen/Qwen3-8B), or remove model.revision"
            )
        return self

    @field_validator("attn_implementation")
    @classmethod
    def _kernel_installed(cls, value: str | None) -> str | None:
        import importlib.util

        if value == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            raise ValueError(
                'attn_implementation = "flash_attention_2" needs the flash-attn package, which is not installed '
                '(pip install flash-attn, on a CUDA machine); or use "sdpa"'
            )
        return value


class TokenizerSection(_Section):
    path: str
    """A tokenizer directory (tokenizer.json, tokenizer_config.json) or a tokenizer.json file."""


class DataSection(_Section):
    path: str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
    """The data: a JSONL file (one JSON object per line), a Parquet or Arrow file (by its suffix, read through
    Hugging Face `datasets`), a glob (`data/train-*.parquet`) or a list of these, read in that order; each a local
    path or a URL an fsspec filesystem reads with the store's credentials (`s3://bucket/data/*.jsonl`), read in place
    (the formats, file types and URLs: docs/data.md)."""
    format: Literal["auto", "messages", "sharegpt", "prompt_completion"] = "auto"
    """The records' format: `messages` (OpenAI chat; RL trajectories too), `sharegpt` (`conversations` of
    `from`/`value`), `prompt_completion` (`prompt` and `completion` strings, loss on the completion), or `auto`:
    each file's first record decides (all files must agree)."""
    kind: Literal[tuple(DATA_KINDS)] = "sft"  # pyright: ignore[reportInvalidTypeForm]
    """Training objective: `sft` (loss on assistant tokens) or `rl` (clipped policy gradient on trajectories)."""
    max_seq_len: int = Field(default=512, ge=8)
    """Longest tokenized conversation; longer ones are handled by `overflow`."""
    overflow: Literal["error", "truncate", "drop"] = "error"
    """What to do with a conversation longer than max_seq_len (truncations and drops are counted in the ledger)."""
    pack: bool = False
    """Pack several conversations per row of max_seq_len tokens, with attention kept within each."""
    advantage_normalization: Literal["mean_std", "mean"] = "mean_std"
    """RL rewards without advantages: group-relative advantages, (r - mean) / std or r - mean."""
    eval_path: str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    """Held-out data evaluated during training (`train.eval_every`, and at the end of every segment): the same
    formats and file types as `path`, read and checked the same way."""
    eval_fraction: float = Field(default=0.0, ge=0, lt=1)
    """Instead of `eval_path`: this fraction of the data's conversations, chosen with `run.seed`, held out of
    training and evaluated (at least one conversation, and at least one left to train on)."""

    @model_validator(mode="after")
    def _one_eval_source(self) -> "DataSection":
        if self.eval_path is not None and self.eval_fraction:
            raise ValueError(
                f"data.eval_path and data.eval_fraction={self.eval_fraction} both say what to evaluate; keep "
                "eval_path (held-out files) or eval_fraction (a seeded split of data.path), not both"
            )
        return self

    @property
    def has_eval(self) -> bool:
        return self.eval_path is not None or self.eval_fraction > 0


class RLSection(_Section):
    clip_low: float = Field(default=0.2, ge=0, lt=1)
    """Lower clip of the importance ratio: r >= 1 - clip_low."""
    clip_high: float = Field(default=0.28, ge=0)
    """Upper clip of the importance ratio: r <= 1 + clip_high."""
    sft_coef: float = Field(default=0.0, ge=0)
    """Weight of an SFT term on the same loss tokens, added to the policy-gradient loss."""
    initial_policy_version: int = Field(default=0, ge=0, le=_INT64_MAX)
    """Policy version of the initial weights; each optimizer step adds one."""
    max_data_staleness: int | None = Field(default=None, ge=0, le=_INT64_MAX)
    """Trajectories generated more than this many policy versions ago are dropped or rejected (None: no bound)."""
    stale_trajectories: Literal["drop", "error"] = "drop"
    """What to do with a trajectory past max_data_staleness (drops are counted)."""


class ExportSection(_Section):
    every_n_segments: int = Field(default=0, ge=0)
    """Also export after every N segments (0: only at the end, which always happens)."""
    max_shard_size: str = "2GB"
    """Safetensors shard size limit, as transformers' `save_pretrained` takes it."""
    timeout_s: float = Field(default=1800, gt=0)
    """Wall-clock limit of one export launch; past it the process group is killed."""
    merge_lora: bool = False
    """With [model.lora]: also write the merged full weights (`merged/`, loads with AutoModelForCausalLM)."""

    def after_segment(self, segment_index: int, num_segments: int) -> bool:
        """Whether a checkpoint is exported after segment `segment_index` (0-based) of `num_segments`."""
        last = segment_index == num_segments - 1
        every = self.every_n_segments
        return last or (every > 0 and (segment_index + 1) % every == 0)

    @field_validator("max_shard_size")
    @classmethod
    def _shard_size(cls, value: str) -> str:
        # Checked here, not at export: a typo must not cost a whole training run.
        from transformers.utils.hub import convert_file_size_to_int

        try:
            size_bytes = convert_file_size_to_int(value.strip())
        except ValueError:
            size_bytes = None
        if size_bytes is None or size_bytes <= 0:
            raise ValueError(
                f"max_shard_size={value!r} is not a positive size; write a whole number and a unit, "
                'such as "2GB", "500MB" or "1GiB"'
            )
        return value


class StorageSection(_Section):
    url: str = ".rankflow/store"
    """Where checkpoints and run state are stored: a local path, `file://…` or `s3://bucket/prefix`. A local store
    may not overlap run.work_dir (the same directory, the work directory inside the store, or the store inside one
    of its run directories or its cache): exit 2."""
    timeout_s: float = Field(default=1800, gt=0)
    """Overall time limit of one commit, cleanup or ledger upload; past it the stage fails, retriably."""
    request_timeout_s: float = Field(default=60, gt=0)
    """Connect and read timeout of one S3 request (3 attempts): a stopped server fails it instead of hanging."""
    keep_last: int | None = None
    """Retention: after each commit, keep the newest N committed checkpoints (plus keep_every's and the one LATEST
    names) and remove the others. Unset: every checkpoint is kept. Never changes the run id."""
    keep_every: int | None = None
    """Retention, with keep_last: also keep every checkpoint whose step is a multiple of K."""
    keep_states: bool = False
    """Keep every segment's training state in the store. False: once a checkpoint commits, the states of the segments
    before it (no longer needed to resume or to export) are removed from the store and the work dir."""

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return check_storage_url(value)

    @field_validator("keep_last", "keep_every")
    @classmethod
    def _positive_count(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value < 1:
            hint = (
                "it would remove every checkpoint; set storage.keep_last = 1 or more (the newest N stay), or remove "
                "the key to keep every checkpoint"
                if info.field_name == "keep_last"
                else "set storage.keep_every = K >= 1 (checkpoints at steps that are multiples of K stay), or remove it"
            )
            raise ValueError(f"storage.{info.field_name} = {value} is not a positive count: {hint}")
        return value

    @model_validator(mode="after")
    def _keep_every_needs_keep_last(self) -> "StorageSection":
        if self.keep_every is not None and self.keep_last is None:
            raise ValueError(
                f"storage.keep_every = {self.keep_every} has no effect without storage.keep_last (every checkpoint is "
                f"kept while keep_last is unset); set storage.keep_last = N to keep the N newest plus every "
                f"{self.keep_every}th step's, or remove keep_every"
            )
        return self

    @property
    def is_s3(self) -> bool:
        return self.url.startswith("s3://")


DEFAULT_TRACKING_URIS = {
    "mlflow": "sqlite:///{work_dir}/mlflow.db",
    "tensorboard": "{work_dir}/tensorboard",
    "wandb": "{work_dir}",
}
"""Where each backend keeps a run's metrics unless tracking.uri says otherwise: under run.work_dir."""


class TrackingSection(_Section):
    backend: Literal[(NO_TRACKING, *TRACKING_BACKENDS)] = "none"  # pyright: ignore[reportInvalidTypeForm]
    """Experiment tracking (infra/tracking): `mlflow`, `tensorboard` or `wandb` (each an extra: pip install
    'rankflow[mlflow]'), or `none`. The params (the resolved config), every step's metrics at the global step, and
    each committed checkpoint's URL; never twice for a step, and an outage never fails the training."""
    uri: str | None = None
    """MLflow's tracking URI, TensorBoard's log directory or W&B's `dir`. Unset: under run.work_dir (MLflow:
    `sqlite:///WORK_DIR/mlflow.db`, TensorBoard: `WORK_DIR/tensorboard`, W&B: `WORK_DIR/wandb`)."""
    experiment: str | None = None
    """MLflow's experiment or W&B's project. Unset: run.name."""


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
    tracking: TrackingSection = TrackingSection()

    @model_validator(mode="after")
    def _merge_needs_an_adapter(self) -> "RunConfig":
        if self.export.merge_lora and self.model.lora is None:
            raise ValueError(
                "export.merge_lora = true but there is no [model.lora] adapter to merge; add a [model.lora] "
                "section, or set export.merge_lora = false"
            )
        return self

    @model_validator(mode="after")
    def _objective_fits_the_data(self) -> "RunConfig":
        kind = DATA_KINDS[self.data.kind]
        if self.train.objective is None:
            self.train.objective = kind.default_objective
        carried = kind.shard_names(packed=self.data.pack)
        missing = [name for name in OBJECTIVE_NEEDS[self.train.objective] if name not in carried]
        if missing:
            raise ValueError(
                f"train.objective={self.train.objective!r} needs {', '.join(missing)}, which "
                f"data.kind={self.data.kind!r} data do not carry; choose an objective for that data "
                f"(e.g. train.objective={kind.default_objective!r}), or give it data that do"
            )
        return self

    @model_validator(mode="after")
    def _continued_adapter_unsharded(self) -> "RunConfig":
        if self.model.lora is not None and self.model.lora.init_from is not None and self.train.shards_weights:
            raise ValueError(
                "a LoRA adapter that continues (model.lora.init_from, or model.path naming a LoRA checkpoint) with "
                f'train.sharding = "{self.train.sharding}": not supported yet; set train.sharding = "none" to continue it'
            )
        return self

    @model_validator(mode="after")
    def _model_path_loads_under_the_parallelism(self) -> "RunConfig":
        if self.model.path is not None and not PARALLELISM_LIMITS[self.train.sharding].loads_model_path:
            raise ValueError(
                f'model.path with train.sharding = "{self.train.sharding}": loading weights into its parts is not '
                'supported yet; set train.sharding = "fsdp", or build the model from model.config'
            )
        return self

    @model_validator(mode="after")
    def _eval_needs_data(self) -> "RunConfig":
        if self.train.eval_every and not self.data.has_eval:
            raise ValueError(
                f"train.eval_every={self.train.eval_every} but there is nothing to evaluate; set data.eval_path "
                "(held-out files) or data.eval_fraction (e.g. 0.05), or remove eval_every"
            )
        return self

    def export_after_segment(self, segment_index: int) -> bool:
        """Whether a checkpoint is exported after segment `segment_index` (0-based)."""
        return self.export.after_segment(segment_index, self.train.num_segments)


def _set_dotted(tree: dict[str, Any], dotted: str, raw_value: str, created: list[str]) -> None:
    """Apply one `--set a.b=value` override; the value is parsed as TOML when it can be.

    Sections it has to create are appended to `created`.
    """
    keys = dotted.split(".")
    if not all(keys):
        raise ConfigError(
            f"--set {dotted}={raw_value}: empty key segment; write it as section.key=value, e.g. train.steps=10"
        )
    try:
        value = tomllib.loads(f"v = {raw_value}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw_value  # a bare string such as a path or a name
    node = tree
    for depth, key in enumerate(keys[:-1]):
        if key not in node:
            created.append(".".join(keys[: depth + 1]))  # a section the file does not have: its errors come from --set
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(
                f"--set {dotted}={raw_value}: '{key}' is a value, not a section; "
                f"set {'.'.join(keys[: keys.index(key) + 1])} itself, or check the key's spelling"
            )
        node = child
    node[keys[-1]] = value


def _unset_dotted(tree: dict[str, Any], dotted: str, source: str) -> None:
    """Apply one `--unset a.b`: the key (a value or a whole section) is removed, as if the file did not set it."""
    keys = dotted.split(".")
    node: Any = tree
    for depth, key in enumerate(keys):
        if not key or not isinstance(node, dict) or key not in node:
            where = ".".join(keys[:depth]) or "the top level"
            present = ", ".join(sorted(node)) if isinstance(node, dict) and node else "no keys"
            raise ConfigError(
                f"--unset {dotted}: {source} does not set {dotted} (under {where} it sets {present}); "
                "unset a key the file sets, e.g. --unset model.config"
            )
        if depth < len(keys) - 1:
            node = node[key]
    del node[keys[-1]]


def _check_revision(model: ModelSection) -> None:
    """model.revision goes with a hub model id (or the snapshot of that commit it resolved to), nothing else."""
    path, revision = model.path, model.revision
    if revision is None or path is None or is_hub_id(path) or Path(path).name == revision:
        return
    raise ConfigError(
        f"model.revision={revision!r} applies to a hub model id in model.path (such as Qwen/Qwen3-8B), not to "
        f"model.path={path!r}; remove model.revision"
    )


def _resolve_paths(config: RunConfig, config_dir: Path) -> RunConfig:
    def inp(value: str, key: str) -> str:
        return str(resolved_path(config_dir / Path(value).expanduser(), key, f"point {key} at a real path"))

    def out(value: str, key: str) -> str:
        return str(resolved_path(value, key, f"point {key} at a directory, not a link that loops"))

    if config.model.path is not None and not _names_fetched_model(config.model.path, config_dir):
        config.model.path = inp(config.model.path, "model.path")
    _check_revision(config.model)
    if config.model.config is not None:
        config.model.config = inp(config.model.config, "model.config")
    if config.model.lora is not None and config.model.lora.init_from is not None:
        config.model.lora.init_from = inp(config.model.lora.init_from, "model.lora.init_from")
    config.tokenizer.path = inp(config.tokenizer.path, "tokenizer.path")
    given = config.data.path
    resolved = [resolve_entry(entry, config_dir) for entry in entries(given)]
    config.data.path = resolved[0] if isinstance(given, str) else resolved
    held_out = config.data.eval_path
    if held_out is not None:
        resolved = [resolve_entry(entry, config_dir, "data.eval_path") for entry in entries(held_out)]
        config.data.eval_path = resolved[0] if isinstance(held_out, str) else resolved
    config.run.work_dir = out(config.run.work_dir, "run.work_dir")
    url = config.storage.url
    if url.startswith("file://"):
        url = url.removeprefix("file://")
    if "://" not in url:  # the scheme itself was checked by StorageSection's validator
        config.storage.url = out(url, "storage.url")
    tracking = config.tracking
    if tracking.backend != "none" and tracking.uri is None:
        tracking.uri = DEFAULT_TRACKING_URIS[tracking.backend].format(work_dir=config.run.work_dir)
    elif tracking.backend != "none" and tracking.uri is not None and "://" not in tracking.uri:
        # a directory (TensorBoard, W&B): as the command's cwd names it
        tracking.uri = out(tracking.uri, "tracking.uri")
    elif tracking.backend != "none" and tracking.uri is not None and tracking.uri.startswith("file://"):
        out(tracking.uri.removeprefix("file://"), "tracking.uri")  # checked only: MLflow reads the URI as given
    if tracking.experiment is None:
        tracking.experiment = config.run.name
    return config


def _check_inputs_exist(
    config: RunConfig, given_data_path: str | list[str], given_eval_path: str | list[str] | None = None
) -> None:
    checks = [
        ("model.path", config.model.path, "a local Hugging Face model directory"),
        ("model.config", config.model.config, "a config.json file"),
        (
            "model.lora.init_from",
            config.model.lora.init_from if config.model.lora else None,
            "a peft adapter directory",
        ),
        ("tokenizer.path", config.tokenizer.path, "tokenizer.json or a tokenizer directory"),
    ]
    for key, value, what in checks:
        if key == "model.path" and value is not None and not Path(value).is_absolute():
            continue  # fetched before planning: from the store (infra/publication/parent.py) or the hub's cache
        if value is not None and not Path(value).exists():
            raise ConfigError(f"{key}={value!r} does not exist; point it at {what}")
    data_files(config.data.path, given_data_path)  # every entry names a local file (or a glob with matches)
    if config.data.eval_path is not None:
        data_files(config.data.eval_path, given_eval_path, key="data.eval_path")


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
    store = local_path(storage_url)
    if store is None:
        return  # an object store cannot overlap a local directory
    work = Path(work_dir).expanduser().resolve()
    how = overlap(store, work)
    if how == "same":
        problem = "are the same directory"
    elif how == "second_inside":
        problem = "overlap: the work directory lies inside the store"
    elif how == "first_inside" and (_RUN_DIR_NAME.match(first := store.relative_to(work).parts[0]) or first == "cache"):
        problem = (
            f"overlap: the store lies inside {work / first}, which rankflow rewrites and deletes "
            "(a run directory with its staged exports, or the data cache)"
        )
    else:
        return
    raise ConfigError(
        f"storage.url={str(store)!r} and run.work_dir={str(work)!r} {problem}; point them at "
        'separate directories, e.g. storage.url = ".rankflow/store" with run.work_dir = ".rankflow"'
    )


def config_from_dict(
    tree: dict[str, Any], *, config_dir: Path, source: str = "(dict)", overridden: tuple[str, ...] = ()
) -> RunConfig:
    """Validate a config tree, resolve its paths and check that its inputs exist.

    `overridden` lists the dotted keys set on the command line, so that their
    errors say so.
    """
    try:
        config = RunConfig.model_validate(tree)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, RunConfig, source, overridden)) from None
    given_data_path, given_eval_path = config.data.path, config.data.eval_path
    config = _resolve_paths(config, config_dir)
    _check_inputs_exist(config, given_data_path, given_eval_path)
    check_locations_disjoint(config.run.work_dir, config.storage.url)
    return config


def load_config(
    path: str | Path, overrides: list[str] | tuple[str, ...] = (), unset: list[str] | tuple[str, ...] = ()
) -> RunConfig:
    """Read a TOML config, remove the `unset` dotted keys, apply `dotted.key=value` overrides and validate it.

    Unsetting comes first, so `--unset model.config --set model.path=DIR` switches how the model is given
    without a new file; a key both unset and set is refused (which one is meant?).
    """
    from .input_files import read_input_text

    path = Path(path)
    text = read_input_text(path, f"config file {str(path)!r}", "pass the path of a TOML config file")
    try:
        tree = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(_toml_error(path, error)) from None
    set_keys = {override.partition("=")[0].strip() for override in overrides}
    for dotted in unset:
        dotted = dotted.strip()
        if dotted in set_keys:
            raise ConfigError(f"--unset {dotted} and --set {dotted}=…: give one of them for {dotted}")
        _unset_dotted(tree, dotted, f"config file {str(path)!r}")
    overridden = []
    for override in overrides:
        dotted, sep, raw_value = override.partition("=")
        if not sep:
            raise ConfigError(f"--set {override!r}: expected dotted.key=value, e.g. --set train.steps=10")
        _set_dotted(tree, dotted.strip(), raw_value.strip(), overridden)
        overridden.append(dotted.strip())
    return config_from_dict(tree, config_dir=path.resolve().parent, source=str(path), overridden=tuple(overridden))


def _toml_error(path: Path, error: tomllib.TOMLDecodeError) -> str:
    """`FILE:LINE:COL: not valid TOML (what); fix`, from tomllib's message (3.11 has no lineno attribute)."""
    message = str(error)
    found = re.search(r" \(at line (\d+), column (\d+)\)$", message)
    where = f"{path}:{found[1]}:{found[2]}" if found else str(path)
    what = message[: found.start()] if found else message.removesuffix(" (at end of document)")
    return f"{where}: not valid TOML ({what}); fix the syntax there (the TOML rules: https://toml.io)"
