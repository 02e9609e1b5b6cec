"""The plan's cache of the per-document stages (render → tokenize → mask → align): their store on disk.

Keyed by everything that decides those stages' output — the data files and
the format they are read in, the tokenizer, the chat template, the advantage normalisation, and
`STAGES_VERSION`, which a change to any stage's logic (or to the store's
layout) must bump. A re-plan of unchanged inputs (a resumed run, a new storage
target, a different length limit) opens the stored documents instead of
reading and tokenizing the file again. An entry is a store directory
(store.py) put in place by one rename, so a crash never leaves a half entry
behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from .store import META_FILE, DocumentStore

STAGES_VERSION = 2
"""2: the entry is a store directory read one document at a time (1 was one safetensors file loaded whole)."""


def cache_key(
    data_sha256: object,
    tokenizer_sha256: str,
    template: str | None,
    normalization: str,
    data_format: str = "messages",
) -> str:
    """`data_sha256`: the fingerprint's data (one digest, or a list of them, one a file)."""
    material = [STAGES_VERSION, data_sha256, tokenizer_sha256, template, normalization]
    if data_format != "messages":  # the messages format keeps the keys of entries stored before there were others
        material.append(data_format)
    return hashlib.sha256(json.dumps(material).encode()).hexdigest()[:32]


def entry_dir(cache_dir: Path, key: str) -> Path:
    return cache_dir / f"{key}.store"


def open_cached(cache_dir: Path, key: str) -> DocumentStore | None:
    """The cached store of `key`, or None."""
    entry = entry_dir(cache_dir, key)
    if not (entry / META_FILE).is_file():
        return None
    return DocumentStore.open(entry)


def keep_store(store: DocumentStore, cache_dir: Path, key: str) -> None:
    """Put a scratch store into the cache (a rename, or a copy from another filesystem).

    The store stays readable through its open file whichever way it went; when
    another plan stored the same entry first, that one is kept and the scratch
    goes when the store is dropped.
    """
    entry = entry_dir(cache_dir, key)
    if entry.is_dir():
        return
    cache_dir.mkdir(parents=True, exist_ok=True)
    aside = cache_dir / f"{key}.tmp-{os.getpid()}"
    try:
        os.rename(store.directory, aside)
    except OSError:  # another filesystem (TMPDIR elsewhere): copy, then rename into place
        shutil.rmtree(aside, ignore_errors=True)
        shutil.copytree(store.directory, aside)
    try:
        os.rename(aside, entry)
    except OSError:  # an entry appeared meanwhile (a concurrent plan of the same data): keep it
        shutil.rmtree(aside, ignore_errors=True)
