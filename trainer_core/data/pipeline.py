"""The staged pipeline over a whole file: records to documents ready for the shards.

    render → tokenize (one batch) → mask → [advantages] → align → fit_length

This module holds a whole file in memory (tests, golden files, the tokenize
benchmark); the plan streams the same stages chunk by chunk into a store on
disk (streaming.py), with the same outputs and digests. The stages up to align
depend only on the file, the tokenizer, the template and the advantage
normalisation, so the plan caches their store (cache.py); fit_length, which
depends on the length limit, always runs.

Every stage is pure; `stage_documents` runs the stages up to align without
writing anything, `finish` applies the length limit, and `prepare` chains
them and keeps one digest per stage (a sha256 over its outputs, in record
order, as each output's `digest` hashes itself), so a change in any stage
shows in the plan as the stage where the outputs first differ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from tokenizers import Tokenizer

from ..data_kinds import SFT_DATA, DataKind, kind_of
from .advantages import AdvantageStats, Normalization, resolve_advantages
from .align import Aligned, align
from .mask import mask
from .render import render
from .schema import DataError, Record
from .tokenize import tokenize

STAGES = ("render", "tokenize", "mask", "align")


@dataclass(frozen=True)
class DataOptions:
    """How the data stages run; read from the config's `data` section."""

    max_seq_len: int = 512
    overflow: Literal["error", "truncate", "drop"] = "error"
    pack: bool = False
    """Pack several documents per row (position ids and document ids in the shard)."""
    advantage_normalization: Normalization = "mean_std"

    @classmethod
    def from_config(cls, data_section: Any) -> "DataOptions":
        return cls(
            max_seq_len=data_section.max_seq_len,
            overflow=data_section.overflow,
            pack=data_section.pack,
            advantage_normalization=data_section.advantage_normalization,
        )


@dataclass(frozen=True)
class Prepared:
    documents: Sequence[Aligned]
    """The documents kept, in file order (a list, or read from the plan's store on access)."""
    wheres: Sequence[str]
    """`FILE:LINE` of each kept document."""
    lengths: np.ndarray
    """int64 [documents]: each kept document's token count (what ordering and packing need, without the tokens)."""
    kind: DataKind
    """The data's kind: what its documents and shards carry."""
    num_records: int
    num_truncated: int = 0
    num_dropped: int = 0
    """Over max_seq_len with overflow=drop, or left without a loss token by truncation."""
    advantage_stats: AdvantageStats | None = None
    stage_digests: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Staged:
    """The outputs of the cached stages (up to align) over a whole file, in record order."""

    documents: list[Aligned]
    kind: DataKind
    advantage_stats: AdvantageStats | None
    stage_digests: dict[str, str]


def _stage_digest(outputs: Sequence[Any]) -> str:
    hasher = hashlib.sha256()
    for output in outputs:
        output.update_digest(hasher)
    return hasher.hexdigest()


def fit_length(
    documents: Sequence[Aligned], wheres: Sequence[str], max_seq_len: int, overflow: str
) -> tuple[list[Aligned], list[str], int, int]:
    """Apply the length limit by policy: error, truncate or drop (counted).

    A document whose only loss tokens were cut off (or sit at position 0, which
    nothing predicts) is dropped and counted as dropped (not as truncated),
    since it would teach nothing.
    """
    kept: list[Aligned] = []
    kept_wheres: list[str] = []
    truncated = dropped = 0
    for doc, where in zip(documents, wheres, strict=True):
        if doc.num_tokens > max_seq_len:
            if overflow == "error":
                raise DataError(
                    f"{where}: field messages: {doc.num_tokens} tokens, over data.max_seq_len={max_seq_len}; "
                    "raise max_seq_len or set data.overflow to 'truncate' or 'drop'"
                )
            if overflow == "drop":
                dropped += 1
                continue
            doc = doc.truncated(max_seq_len)
            if doc.loss_mask[1:].any():
                truncated += 1
        if not doc.loss_mask[1:].any():
            dropped += 1
            continue
        kept.append(doc)
        kept_wheres.append(where)
    return kept, kept_wheres, truncated, dropped


def _stage_outputs(
    records: Sequence[Record], tokenizer: Tokenizer, template: str | None, normalization: Normalization
) -> tuple[list[Aligned], DataKind, AdvantageStats | None, dict[str, str]]:
    conversations = [r.conversation for r in records]
    wheres = [r.where for r in records]
    rendered = [render(c, template, where=w) for c, w in zip(conversations, wheres)]
    tokenized = tokenize(tokenizer, rendered)
    masked = [mask(t, r) for t, r in zip(tokenized, rendered)]
    kind = kind_of(conversations[0]) if conversations else SFT_DATA
    stats = None
    if kind.carries("advantages"):
        message_advantages, stats = resolve_advantages(conversations, wheres, normalization)
    else:
        message_advantages = [None] * len(conversations)
    aligned = [align(m, c, a, where=w) for m, c, a, w in zip(masked, conversations, message_advantages, wheres)]
    digests = {
        "render": _stage_digest(rendered),
        "tokenize": _stage_digest(tokenized),
        "mask": _stage_digest(masked),
        "align": _stage_digest(aligned),
    }
    return aligned, kind, stats, digests


def stage_documents(
    records: Sequence[Record], tokenizer: Tokenizer, template: str | None, normalization: Normalization
) -> Staged:
    """render → tokenize → mask → [advantages] → align over `records`; the first bad record raises DataError."""
    aligned, kind, stats, digests = _stage_outputs(records, tokenizer, template, normalization)
    return Staged(aligned, kind, stats, digests)


def finish(staged: Staged, records: Sequence[Record], options: DataOptions) -> Prepared:
    """Apply the length limit (see `fit_length`); an input left with nothing to train on is a DataError."""
    wheres = [r.where for r in records]
    documents, kept_wheres, truncated, dropped = fit_length(
        staged.documents, wheres, options.max_seq_len, options.overflow
    )
    if not documents:
        source = wheres[0].rsplit(":", 1)[0] if wheres else "(data)"
        shortest = min((d.num_tokens for d in staged.documents), default=0)
        raise DataError(
            f"{source}: no conversation left with loss tokens after applying data.max_seq_len={options.max_seq_len} "
            f"(data.overflow={options.overflow!r}); raise data.max_seq_len (the shortest conversation has {shortest} tokens)"
        )
    return Prepared(
        documents=documents,
        wheres=kept_wheres,
        lengths=np.array([d.num_tokens for d in documents], dtype=np.int64),
        kind=staged.kind,
        num_records=len(records),
        num_truncated=truncated,
        num_dropped=dropped,
        advantage_stats=staged.advantage_stats,
        stage_digests=staged.stage_digests,
    )


def prepare(records: Sequence[Record], tokenizer: Tokenizer, template: str | None, options: DataOptions) -> Prepared:
    """Run every per-document stage over `records`, in memory; the first bad record raises DataError."""
    return finish(stage_documents(records, tokenizer, template, options.advantage_normalization), records, options)
