"""Aligned documents on disk, read one at a time: what lets the plan stream a dataset of any size.

A store is a directory:

- `documents.bin`: each document's arrays back to back, in record order:
  `input_ids` (int64), then for RL `behaviour_logprobs` and `advantages`
  (float32), then `loss_mask` (bool): 9 bytes a token for SFT, 17 for RL;
- `index.npz`: per document (int64 each) its byte offset, token count, first
  target (the first position t >= 1 whose `loss_mask` is set, or its length
  when none: what the length limit needs without reading the tokens), line
  (or row) in its data file and, for RL, policy version;
- `meta.json`: the record count, the kind, the advantage statistics, the
  stage digests and how many records each data file gave (so a document's file
  is found from its index: no per-document file column).

Only the index lives in memory: 40 bytes a conversation (48 for RL), so
10^7 conversations index in ~400 MB while their tokens stay on disk. A
document is read back with one `pread` (not a memory map, whose pages would
count towards the process's resident memory as the plan walks the data).
"""

from __future__ import annotations

import json
import os
import weakref
from array import array
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import overload

import numpy as np

from ..data_kinds import RL_DATA, SFT_DATA, DataKind
from ..data_sources import DataFile
from .advantages import AdvantageStats
from .align import Aligned

DOCUMENTS_FILE = "documents.bin"
INDEX_FILE = "index.npz"
META_FILE = "meta.json"
_STORED_KIND = "is_rl"
"""The meta key of the store's kind, a flag since before kinds had names (cached stores keep their format)."""
INDEX_BYTES_PER_DOCUMENT = 5 * 8
"""offset, length, first target, line, and (RL) policy version: int64 each (the offsets have one more entry)."""


def first_target(loss_mask: np.ndarray) -> int:
    """The first position t >= 1 that is a target, or the document's length when none is."""
    found = np.flatnonzero(loss_mask[1:])
    return int(found[0]) + 1 if found.size else len(loss_mask)


class StoreWriter:
    """Appends aligned documents to a new store directory (buffered writes; nothing held per token)."""

    def __init__(self, directory: Path, *, kind: DataKind, num_files: int = 1) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.kind = kind
        self._file = open(directory / DOCUMENTS_FILE, "wb", buffering=1 << 20)
        self._offset = 0
        # array('q'): 8 bytes an entry while the file streams in (a list of ints would take ~36).
        self._columns = {name: array("q") for name in ("offsets", "lengths", "first_targets", "lines", "versions")}
        self._columns["offsets"].append(0)
        self._file_documents = [0] * num_files

    def append(self, document: Aligned, line: int, file_index: int = 0) -> None:
        """Add the next document, from `line` (or row) of data file `file_index` (files come in order)."""
        parts = [document.input_ids.astype(np.int64, copy=False)]
        if self.kind.carries("advantages"):
            if document.behaviour_logprobs is None or document.advantages is None or document.policy_version is None:
                raise ValueError("an RL document without its behaviour logprobs, advantages or version")
            parts += [document.behaviour_logprobs.astype(np.float32, copy=False), document.advantages]
            self._columns["versions"].append(document.policy_version)
        parts.append(document.loss_mask.astype(bool, copy=False))
        for part in parts:
            self._file.write(np.ascontiguousarray(part).data)
        self._offset += sum(part.nbytes for part in parts)
        self._columns["offsets"].append(self._offset)
        self._columns["lengths"].append(document.num_tokens)
        self._columns["first_targets"].append(first_target(document.loss_mask))
        self._columns["lines"].append(line)
        self._file_documents[file_index] += 1

    def finish(self, *, num_records: int, stats: AdvantageStats | None, digests: dict[str, str]) -> "DocumentStore":
        self._file.close()
        columns = {name: np.frombuffer(values, dtype=np.int64) for name, values in self._columns.items()}
        if not self.kind.carries("policy_version"):
            columns.pop("versions")
        np.savez(self.directory / INDEX_FILE, allow_pickle=False, **columns)
        meta = {
            "num_records": num_records,
            _STORED_KIND: self.kind is RL_DATA,
            "stats": asdict(stats) if stats else None,
            "digests": digests,
            "file_documents": self._file_documents,
        }
        (self.directory / META_FILE).write_text(json.dumps(meta, sort_keys=True))
        return DocumentStore.open(self.directory)

    def abort(self) -> None:
        self._file.close()


class DocumentStore:
    """A finished store: the index in memory, the documents on disk (`document(i)` reads one)."""

    def __init__(
        self, directory: Path, columns: dict[str, np.ndarray], meta: dict, *, remove_when_unused: bool = False
    ) -> None:
        self.directory = directory
        self.offsets = columns["offsets"]
        self.lengths = columns["lengths"]
        self.first_targets = columns["first_targets"]
        self.lines = columns["lines"]
        self.versions = columns.get("versions")
        self.num_records: int = meta["num_records"]
        self.kind = RL_DATA if meta[_STORED_KIND] else SFT_DATA
        self.stats = AdvantageStats(**meta["stats"]) if meta["stats"] else None
        self.stage_digests: dict[str, str] = meta["digests"]
        # Entries written before data.path could name several files hold one file's documents.
        self.file_ends = np.cumsum(meta.get("file_documents", [len(self.lengths)]), dtype=np.int64)
        """The store index just past each data file's documents."""
        self._fd = os.open(directory / DOCUMENTS_FILE, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._finalizer = weakref.finalize(self, _release, self._fd, str(directory) if remove_when_unused else None)

    @classmethod
    def open(cls, directory: Path, *, remove_when_unused: bool = False) -> "DocumentStore":
        with np.load(directory / INDEX_FILE) as index:
            columns = {name: index[name] for name in index.files}
        meta = json.loads((directory / META_FILE).read_text())
        return cls(directory, columns, meta, remove_when_unused=remove_when_unused)

    def __len__(self) -> int:
        return len(self.lengths)

    def close(self) -> None:
        """Close the file (and remove a scratch store's directory)."""
        self._finalizer()

    def document(self, index: int) -> Aligned:
        length = int(self.lengths[index])
        start = int(self.offsets[index])
        raw = os.pread(self._fd, int(self.offsets[index + 1]) - start, start)
        input_ids = np.frombuffer(raw, dtype=np.int64, count=length)
        if not self.kind.carries("advantages"):
            return Aligned(input_ids=input_ids, loss_mask=np.frombuffer(raw, dtype=bool, offset=8 * length))
        assert self.versions is not None  # an RL store keeps one version per document
        return Aligned(
            input_ids=input_ids,
            loss_mask=np.frombuffer(raw, dtype=bool, offset=16 * length),
            behaviour_logprobs=np.frombuffer(raw, dtype=np.float32, count=length, offset=8 * length),
            advantages=np.frombuffer(raw, dtype=np.float32, count=length, offset=12 * length),
            policy_version=int(self.versions[index]),
        )


def _release(fd: int, directory: str | None) -> None:
    os.close(fd)
    if directory is not None:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)


class KeptDocuments(Sequence[Aligned]):
    """The documents the length limit keeps, read from the store on access (truncated to their kept length)."""

    def __init__(self, store: DocumentStore, indices: np.ndarray, lengths: np.ndarray) -> None:
        self.store = store
        self.indices = indices
        """Store index of each kept document."""
        self.lengths = lengths
        """Kept length of each (its length, or `data.max_seq_len` when truncated)."""

    def __len__(self) -> int:
        return len(self.indices)

    @overload
    def __getitem__(self, index: int) -> Aligned: ...
    @overload
    def __getitem__(self, index: slice) -> list[Aligned]: ...
    def __getitem__(self, index: int | slice) -> Aligned | list[Aligned]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        document = self.store.document(int(self.indices[index]))
        length = int(self.lengths[index])
        return document if length == document.num_tokens else document.truncated(length)


class KeptWheres(Sequence[str]):
    """`FILE:LINE` (or `FILE:row N`) of each kept document, made on access."""

    def __init__(
        self, files: Sequence[DataFile], file_ends: np.ndarray, indices: np.ndarray, lines: np.ndarray
    ) -> None:
        self.files, self.file_ends, self.indices, self.lines = files, file_ends, indices, lines

    def __len__(self) -> int:
        return len(self.lines)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        file_index = int(np.searchsorted(self.file_ends, self.indices[index], side="right"))
        return self.files[file_index].where(int(self.lines[index]))
