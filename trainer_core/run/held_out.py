"""Held-out data: what a run evaluates during training, and its shard.

Two sources, one at a time:

- `data.eval_path`: other files, read, staged and checked exactly as `data.path` is (formats, file types, every
  bad-input message with the file, row and field, and `data.eval_path` named as the setting); their bytes join the
  inputs' fingerprint, so they are part of the run id. Training is unchanged by them.
- `data.eval_fraction`: that fraction of the kept conversations of `data.path`, chosen by a permutation seeded with
  `run.seed` (its own stream, not the training order's), leaves training; the rest train in the order and packing
  they would have with only those conversations. The fraction is in the digest (it decides what trains).

The eval shard (`plan/eval.safetensors`) holds every held-out conversation as an unpacked row (the training
shards' tensor contract, `trainer_core/data/shards.py`, without the step dimension), sorted by length so that a
forward's rows need little padding once trimmed. Its size is the held-out tokens times the row length of the
longest one: keep the held-out set small (a few thousand conversations) at real sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, overload

import numpy as np
import torch

from trainer_core.data import DataError, DataOptions, Prepared
from trainer_core.data.cache import cache_key, keep_store
from trainer_core.data.records import DataSource, open_source
from trainer_core.data.shards import stack_rows, unpacked_steps
from trainer_core.data.store import DocumentStore
from trainer_core.data.streaming import fit_store
from trainer_core.data_sources import data_digest
from trainer_core.run.staging import cached_or_staged

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from trainer_core.config import RunConfig

EVAL_SHARD_FILE = "plan/eval.safetensors"
_SPLIT_STREAM = 0x5E1D  # the held-out permutation's own seed stream: the training order's draws stay as they were


@dataclass(frozen=True)
class HeldOutFiles:
    """`data.eval_path`, staged and checked: its store (scratch or cached) and the documents it keeps."""

    source: DataSource
    digest: str | list[str]
    cache_key: str
    store: DocumentStore
    from_cache: bool
    prepared: Prepared

    def fingerprint(self) -> dict:
        """What the inputs' fingerprint adds for these files (their bytes, their format where not messages)."""
        added: dict[str, object] = {"eval_data": self.digest}
        if self.source.format_name != "messages":
            added["eval_data_format"] = self.source.format_name
        return added

    def store_cache(self, cache_dir: Path) -> None:
        if not self.from_cache:
            keep_store(self.store, cache_dir, self.cache_key)

    def close(self) -> None:
        self.store.close()


def stage_eval_files(
    config: RunConfig, tokenizer: Tokenizer, template: str | None, tokenizer_sha256: str, options: DataOptions
) -> HeldOutFiles | None:
    """Read and check `data.eval_path` (None when unset) through the data stages; writes only a scratch store.

    The caller runs its record-kind and position checks on `prepared` (as for `data.path`) and closes the store
    if they fail."""
    if config.data.eval_path is None:
        return None
    source = open_source(config.data.eval_path, config.data.format, key="data.eval_path")
    digest = data_digest(source.files)
    key = cache_key(digest, tokenizer_sha256, template, options.advantage_normalization, source.format_name)
    cache_dir = Path(config.run.work_dir) / "cache"
    normalization = options.advantage_normalization
    with source.fields_as_written():  # a ShareGPT record's error says `conversations`, as its file does
        store, from_cache = cached_or_staged(source, digest, key, cache_dir, tokenizer, template, normalization)
    try:
        with source.fields_as_written():
            prepared = fit_store(store, source, options)
    except BaseException:
        store.close()
        raise
    return HeldOutFiles(source, digest, key, store, from_cache, prepared)


class Picked(Sequence):
    """Some items of a sequence, by index, read on access (a held-out split of the plan's stored documents)."""

    def __init__(self, items: Sequence, indices: np.ndarray) -> None:
        self.items, self.indices = items, indices

    def __len__(self) -> int:
        return len(self.indices)

    @overload
    def __getitem__(self, index: int): ...
    @overload
    def __getitem__(self, index: slice) -> list: ...
    def __getitem__(self, index: int | slice):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self.items[int(self.indices[index])]


def _picked(prepared: Prepared, indices: np.ndarray) -> Prepared:
    return replace(
        prepared,
        documents=Picked(prepared.documents, indices),
        wheres=Picked(prepared.wheres, indices),
        lengths=prepared.lengths[indices],
    )


def held_out_count(count: int, fraction: float, label: str) -> int:
    """How many of `count` kept documents `fraction` holds out (rounded, at least one); a DataError when none would
    be left to train on (the pre-flight checks it, before anything is written)."""
    held = min(max(1, round(fraction * count)), count)
    if held >= count:
        raise DataError(
            f"{label}: data.eval_fraction={fraction} of {count} conversation(s) leaves none to train on; lower "
            "eval_fraction, add conversations, or hold out files of their own with data.eval_path"
        )
    return held


def split_held_out(prepared: Prepared, fraction: float, seed: int, label: str) -> tuple[Prepared, Prepared]:
    """(what trains, what is held out): `fraction` of the kept documents (`held_out_count`), chosen with `seed`;
    both keep file order."""
    count = len(prepared.lengths)
    held = held_out_count(count, fraction, label)
    chosen = np.random.default_rng([seed, _SPLIT_STREAM]).permutation(count)[:held]
    is_held = np.zeros(count, dtype=bool)
    is_held[chosen] = True
    return _picked(prepared, np.flatnonzero(~is_held)), _picked(prepared, np.flatnonzero(is_held))


def eval_shard(held_out: Prepared, pad_id: int) -> dict[str, torch.Tensor]:
    """Every held-out document as one unpacked row, shortest first ([N, T] tensors of the shard contract)."""
    order = np.argsort(held_out.lengths, kind="stable")
    (rows,) = unpacked_steps(held_out.documents, order[None, :], pad_id)
    return {name: tensor[0] for name, tensor in stack_rows([rows], packed=False).items()}
