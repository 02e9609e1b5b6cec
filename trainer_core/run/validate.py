"""Pre-flight: read and check every input of a run without writing anything.

`validate_inputs(config)` is what `rankflow run` calls before the Prefect flow
starts, and what the plan stage calls first, so bad input fails in seconds,
with one message, before a cache entry, a run directory or a store object
exists:

- outputs: `run.work_dir` and a local `storage.url` are (or can become) directories;
- tokenizer: tokenizer.json, tokenizer_config.json and the chat template read, parse and compile;
- model: config.json, sizes, a meta-device forward, the vocabulary, the weights (`model_checks`);
- data: every record (schema, then render → tokenize → mask → align), `data.kind`
  against the records, the length policy, positions against the model;
- the plan's size against this machine's memory and disk (`plan_size`);
- the bytes each training rank will hold against the device's memory (`device_memory`).

Every failure is a `BadInputError` (ConfigError or DataError) naming the file
and line or the config key, and the fix. The data streams through the stages
chunk by chunk into a scratch store in the system's temporary space
(`trainer_core.data.streaming`), removed if any record fails; `CheckedInputs`
keeps it, and its `store_cache()` moves it into the stage cache once the caller
has decided the inputs are good, so tokenizing happens once.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from trainer_core.config import RunConfig
from trainer_core.data import DataError, DataOptions, Prepared, load_chat_template, load_tokenizer
from trainer_core.data.cache import cache_key, keep_store
from trainer_core.data.records import DataSource, open_source
from trainer_core.data.shards import round_up
from trainer_core.data.store import DocumentStore
from trainer_core.data.streaming import fit_store
from trainer_core.data.tokenize import tokenizer_file
from trainer_core.data_sources import data_digest
from trainer_core.errors import ConfigError
from trainer_core.files import sha256_file
from trainer_core.input_files import file_kind
from trainer_core.model_checks import check_model, quiet_transformers
from trainer_core.run.device_memory import MemoryReport, check_device_memory
from trainer_core.run.held_out import HeldOutFiles, held_out_count, stage_eval_files
from trainer_core.run.parent_record import PARENT_FILE, run_parent
from trainer_core.run.plan_size import PlanSize, check_plan_size
from trainer_core.run.staging import cached_or_staged

if TYPE_CHECKING:  # transformers (2-3 s) is imported by the checks that use it: importing this module stays light
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class CheckedInputs:
    """Everything the plan needs, read and checked; nothing written yet."""

    config: RunConfig
    tokenizer: Tokenizer
    template: str | None
    model_config: PretrainedConfig
    options: DataOptions
    source: DataSource
    """The data's files and the format they are read in."""
    fingerprint: dict
    """Digests of the inputs that decide the result (see `input_fingerprint`)."""
    cache_key: str
    store: DocumentStore
    """The documents up to align, on disk: a scratch store, or the stage cache's entry."""
    from_cache: bool
    prepared: Prepared
    plan_size: PlanSize
    memory: MemoryReport | None = None
    """The memory model's prediction per training rank, and what it was checked against."""
    held_out: HeldOutFiles | None = None
    """`data.eval_path`, staged and checked (None without it; `data.eval_fraction` is split by the plan)."""

    @property
    def cache_dir(self) -> Path:
        return Path(self.config.run.work_dir) / "cache"

    def store_cache(self) -> None:
        """Move the staged documents into the stage cache (a no-op when they came from it)."""
        if not self.from_cache:
            keep_store(self.store, self.cache_dir, self.cache_key)
        if self.held_out is not None:
            self.held_out.store_cache(self.cache_dir)


def _check_output_dir(path: str, key: str) -> None:
    """`path` is a directory, or can be created as one by this user."""
    target = Path(path)
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "a regular file" if existing.is_file() else file_kind(existing.stat().st_mode)
        where = "" if existing == target else f" (its parent {str(existing)!r} is {what})"
        raise ConfigError(
            f"{key}={path!r} cannot be a directory{where or f': it is {what}'}; "
            f"point {key} at a directory, or remove that file"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{key}={path!r}: {str(existing)!r} is not writable by this user; "
            f"point {key} at a writable directory, or change its permissions"
        )


def check_outputs(config: RunConfig) -> None:
    _check_output_dir(config.run.work_dir, "run.work_dir")
    if "://" not in config.storage.url:
        _check_output_dir(config.storage.url, "storage.url")


def input_fingerprint(config: RunConfig, template: str | None, source: DataSource | None = None) -> dict:
    """Digests of the inputs that decide the result (paths themselves do not).

    The data is each file's bytes, in order (one file: its digest, as before
    lists), and the format the records were read in when it is not the
    messages format (which every plan before other formats read).
    """
    source = source or open_source(config.data.path, config.data.format)
    fingerprint: dict[str, object] = {
        "data": data_digest(source.files),  # through open_input: a FIFO fails by name, never blocks
        "tokenizer": sha256_file(tokenizer_file(config.tokenizer.path)),
    }
    if source.format_name != "messages":
        fingerprint["data_format"] = source.format_name
    if template is not None:  # the tokenizer's own template decides the tokens and the masks
        fingerprint["chat_template"] = hashlib.sha256(template.encode()).hexdigest()
    if config.model.config is not None:
        fingerprint["model_config"] = sha256_file(Path(config.model.config))
    else:
        assert config.model.path is not None  # the config holds exactly one of model.config and model.path
        model_dir = Path(config.model.path)
        # Hashing multi-GB weights would dominate planning; name + size + config is
        # enough to notice a different model in the same directory.
        fingerprint["model_dir"] = sorted((p.name, p.stat().st_size) for p in model_dir.iterdir() if p.is_file())
        fingerprint["model_config"] = sha256_file(model_dir / "config.json")
        parent = run_parent(config)
        if parent is not None:  # a committed checkpoint: its manifest pins every file's sha256
            fingerprint["model_dir"] = [p for p in fingerprint["model_dir"] if p[0] != PARENT_FILE]
            fingerprint["parent_manifest_sha256"] = parent["manifest_sha256"]
    if config.model.lora is not None and config.model.lora.init_from is not None:  # the adapter's starting weights
        fingerprint["lora_init"] = sha256_file(Path(config.model.lora.init_from) / "adapter_model.safetensors")
    return fingerprint


def _check_template(template: str, config: RunConfig) -> None:
    """Compile the chat template as transformers will, so a syntax error names the template, not every record."""
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except TemplateError as error:
        lineno = getattr(error, "lineno", None)  # a TemplateSyntaxError has one; other TemplateErrors do not
        line = f"line {lineno}: " if lineno else ""
        raise ConfigError(
            f"tokenizer.path={config.tokenizer.path!r}: the chat template does not compile "
            f"({line}{error}); fix its Jinja syntax, or remove it to train with ChatML"
        ) from None


def check_kind(config: RunConfig, source: DataSource, store: DocumentStore) -> None:
    if store.kind.name != config.data.kind:
        raise DataError(f"{source.label}: {store.kind.misread_as_other.format(configured=config.data.kind)}")


def check_positions(config: RunConfig, prepared: Prepared, model_config: PretrainedConfig) -> None:
    """Positions past the model's table would index out of it (absolute) or extrapolate untrained (rotary)."""
    limit = getattr(model_config, "max_position_embeddings", None)
    if not limit:
        return
    longest_index = int(prepared.lengths.argmax())
    longest = int(prepared.lengths[longest_index])
    # Unpacked rows run positions 0..T-1 over the padded row; packed rows restart them per document.
    needed = longest if config.data.pack else round_up(longest)
    if needed > limit:
        raise DataError(
            f"{prepared.wheres[longest_index]}: field messages: {longest} tokens need {needed} positions, more than "
            f"the model's max_position_embeddings={limit}; set data.max_seq_len to at most {limit - limit % 8} "
            "(with data.overflow='truncate' or 'drop'), or use a model with more positions"
        )


def validate_inputs(config: RunConfig) -> CheckedInputs:
    """Every check of the module docstring, cheapest first; writes nothing."""
    check_outputs(config)
    tokenizer = load_tokenizer(config.tokenizer.path)
    template = load_chat_template(config.tokenizer.path)
    if template is not None:
        _check_template(template, config)
    model_config = check_model(config, tokenizer.get_vocab_size())
    with quiet_transformers():
        _check_export_tokenizer(config)
    options = DataOptions.from_config(config.data)
    source = open_source(config.data.path, config.data.format)
    fingerprint = input_fingerprint(config, template, source)
    key = cache_key(
        fingerprint["data"], fingerprint["tokenizer"], template, options.advantage_normalization, source.format_name
    )
    # A cached store's data had the same bytes (the key holds their digest), so every record passed then.
    cache_dir = Path(config.run.work_dir) / "cache"
    normalization = options.advantage_normalization
    with source.fields_as_written():  # a ShareGPT record's error says `conversations`, as its file does
        store, from_cache = cached_or_staged(
            source, fingerprint["data"], key, cache_dir, tokenizer, template, normalization
        )
    held_out = None
    try:
        with source.fields_as_written():
            check_kind(config, source, store)
            prepared = fit_store(store, source, options)
            check_positions(config, prepared, model_config)
        if config.data.eval_fraction:
            held_out_count(len(prepared.lengths), config.data.eval_fraction, source.label)
        held_out = stage_eval_files(config, tokenizer, template, fingerprint["tokenizer"], options)
        if held_out is not None:
            if held_out.store.kind.name != config.data.kind:
                raise DataError(
                    f"{held_out.source.label}: data.eval_path holds {held_out.store.kind.records}, and the run trains "
                    f"data.kind={config.data.kind!r}; hold out data of the kind the run trains on"
                )
            check_positions(config, held_out.prepared, model_config)
            fingerprint.update(held_out.fingerprint())
        size = check_plan_size(config, prepared)
        # A forward runs the training's rows or the held-out ones (unpacked, as long as their longest): the longer.
        row_len = (
            size.row_len if held_out is None else max(size.row_len, round_up(int(held_out.prepared.lengths.max())))
        )
        with quiet_transformers():
            memory = check_device_memory(config, model_config, row_len)
    except BaseException:
        store.close()  # a scratch store goes at once, not when the garbage collector finds it
        if held_out is not None:
            held_out.close()
        raise
    return CheckedInputs(
        config=config,
        tokenizer=tokenizer,
        template=template,
        model_config=model_config,
        options=options,
        source=source,
        fingerprint=fingerprint,
        cache_key=key,
        store=store,
        from_cache=from_cache,
        prepared=prepared,
        plan_size=size,
        memory=memory,
        held_out=held_out,
    )


def _check_export_tokenizer(config: RunConfig) -> None:
    """The export writes the tokenizer after training: a tokenizer_config.json it cannot load must fail now."""
    from trainer_core.export import build_export_tokenizer

    try:
        build_export_tokenizer(config)
    except (ConfigError, DataError):
        raise
    except Exception as error:  # noqa: BLE001 - transformers raises many types for a bad tokenizer directory
        raise ConfigError(
            f"tokenizer.path={config.tokenizer.path!r}: transformers cannot load it for the export "
            f"({type(error).__name__}: {' '.join(str(error).split())[:300]}); fix tokenizer_config.json, "
            "or point tokenizer.path at tokenizer.json alone"
        ) from None
