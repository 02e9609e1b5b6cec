"""The staged pipeline over data of any size: records stream through in chunks into a store on disk.

    read a chunk → render → tokenize (one batch per chunk) → mask → [advantages] → align → append to the store

`pipeline.prepare` holds all the records in memory; this is the same stages, with
the same outputs and the same stage digests (each is a sha256 fed in record
order, so feeding it chunk by chunk gives the same bytes), for the plan: only
one chunk of records and its tokens is in memory at a time, and the documents
land in a `DocumentStore` (store.py) whose index is all that stays.

RL advantages are normalised over groups that may span the whole data, so RL
data is read twice: first for the rewards alone (a few numbers a trajectory),
then for the stages. The store counts each file's records, so a document's
`FILE:LINE` (or `FILE:row N`) is known from its index alone.

`fit_store` applies the length limit (`pipeline.fit_length`'s rules) from the
store's index alone, without reading a token.
"""

from __future__ import annotations

import hashlib
import itertools
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from ..data_kinds import kind_of
from .advantages import AdvantageStats, Normalization, resolve_advantages
from .align import align
from .mask import mask
from .pipeline import STAGES, DataOptions, Prepared
from .records import DataSource, iter_source
from .render import render
from .schema import DataError, Record
from .store import DocumentStore, KeptDocuments, KeptWheres, StoreWriter
from .tokenize import tokenize

CHUNK_RECORDS = 1024
"""Records rendered and tokenized together: enough for the tokenizer's batch to use its threads, few enough to be small."""


@dataclass(frozen=True)
class _MessageRewards:
    reward: float | None
    advantage: float | None


@dataclass(frozen=True)
class _TrajectoryRewards:
    reward: float | None
    advantage: float | None
    group_id: str | int | None
    messages: tuple[_MessageRewards, ...]


def _chunks(records: Iterator[Record]) -> Iterator[list[Record]]:
    while chunk := list(itertools.islice(records, CHUNK_RECORDS)):
        yield chunk


def _rewards_pass(source: DataSource, normalization: Normalization) -> tuple[list[np.ndarray], AdvantageStats]:
    """Every record's per-message advantages, from a first pass that keeps only the reward fields."""
    rewards, wheres = [], []
    for record in iter_source(source):
        c = record.conversation
        messages = tuple(_MessageRewards(m.reward, m.advantage) for m in c.messages)
        rewards.append(_TrajectoryRewards(c.reward, c.advantage, c.group_id, messages))
        wheres.append(record.where)
    return resolve_advantages(rewards, wheres, normalization)


def _stage_chunk(
    chunk: Sequence[Record],
    tokenizer: Tokenizer,
    template: str | None,
    advantages: Sequence[np.ndarray | None],
    hashers: dict[str, hashlib._Hash],
    writer: StoreWriter,
) -> None:
    conversations = [r.conversation for r in chunk]
    rendered = [render(r.conversation, template, where=r.where) for r in chunk]
    tokenized = tokenize(tokenizer, rendered)
    masked = [mask(t, r) for t, r in zip(tokenized, rendered)]
    aligned = [align(m, c, a, where=r.where) for m, c, a, r in zip(masked, conversations, advantages, chunk)]
    for stage, outputs in zip(STAGES, (rendered, tokenized, masked, aligned)):
        for output in outputs:
            output.update_digest(hashers[stage])
    for document, record in zip(aligned, chunk):
        writer.append(document, record.position, record.file_index)


def stage_source(
    source: DataSource, tokenizer: Tokenizer, template: str | None, normalization: Normalization, directory: Path
) -> DocumentStore:
    """Stream the data through the stages into a store at `directory`; the first bad record raises DataError."""
    first = next(iter_source(source))  # the kind decides whether advantages need a pass of their own
    kind = kind_of(first.conversation)
    advantages: list[np.ndarray] | None = None
    stats = None
    if kind.carries("advantages"):
        advantages, stats = _rewards_pass(source, normalization)
    hashers = {stage: hashlib.sha256() for stage in STAGES}
    writer = StoreWriter(directory, kind=kind, num_files=len(source.files))
    num_records = 0
    try:
        for chunk in _chunks(iter_source(source)):
            given = advantages[num_records : num_records + len(chunk)] if advantages else [None] * len(chunk)
            _stage_chunk(chunk, tokenizer, template, given, hashers, writer)
            num_records += len(chunk)
    except BaseException:
        writer.abort()
        raise
    digests = {stage: hasher.hexdigest() for stage, hasher in hashers.items()}
    return writer.finish(num_records=num_records, stats=stats, digests=digests)


def stage_to_scratch(
    source: DataSource, tokenizer: Tokenizer, template: str | None, normalization: Normalization
) -> DocumentStore:
    """`stage_source` into a scratch directory of the system's temporary space (`TMPDIR`).

    The inputs are not validated until the last record has passed, so the tokens
    cannot go under `run.work_dir` yet; the scratch is removed if any record
    fails, and when the store is dropped unless `cache.keep_store` moved it into
    the stage cache.
    """
    scratch = Path(tempfile.mkdtemp(prefix="rankflow-stages-"))
    try:
        store = stage_source(source, tokenizer, template, normalization, scratch)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    store.close()
    return DocumentStore.open(scratch, remove_when_unused=True)


def fit_store(store: DocumentStore, source: DataSource, options: DataOptions) -> Prepared:
    """`pipeline.finish` over a store: the length limit by policy, from the index (see `pipeline.fit_length`)."""
    lengths, limit = store.lengths, options.max_seq_len
    over = lengths > limit
    wheres = KeptWheres(source.files, store.file_ends, np.arange(len(store)), store.lines)
    if options.overflow == "error" and over.any():
        index = int(np.argmax(over))
        raise DataError(
            f"{wheres[index]}: field messages: {int(lengths[index])} tokens, over data.max_seq_len={limit}; "
            "raise max_seq_len or set data.overflow to 'truncate' or 'drop'"
        )
    kept_lengths = np.minimum(lengths, limit) if options.overflow == "truncate" else lengths
    # A document whose first target was cut off (or that has none) would teach nothing: dropped.
    keep = store.first_targets < kept_lengths
    if options.overflow == "drop":
        keep &= ~over
    indices = np.flatnonzero(keep)
    if not indices.size:
        raise DataError(
            f"{source.label}: no conversation left with loss tokens after applying data.max_seq_len={limit} "
            f"(data.overflow={options.overflow!r}); raise data.max_seq_len (the shortest conversation has "
            f"{int(lengths.min())} tokens)"
        )
    return Prepared(
        documents=KeptDocuments(store, indices, kept_lengths[indices]),
        wheres=KeptWheres(source.files, store.file_ends, indices, store.lines[indices]),
        lengths=kept_lengths[indices],
        kind=store.kind,
        num_records=store.num_records,
        num_truncated=int((over & keep).sum()) if options.overflow == "truncate" else 0,
        num_dropped=len(store) - len(indices),
        advantage_stats=store.stats,
        stage_digests=store.stage_digests,
    )
