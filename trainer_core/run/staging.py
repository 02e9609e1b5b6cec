"""The documents of a data source, from the stage cache or staged now: one way for `data.path` and `data.eval_path`.

A cached store's data had the same bytes (the cache key holds their digest), so every record passed then. A store
staged now is checked against the digest taken before reading: records that are not (all) the bytes the run id
names would put other data in the plan, and in the stage cache under that digest, than the fingerprint says.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from trainer_core.data import DataError
from trainer_core.data.cache import open_cached
from trainer_core.data.streaming import stage_to_scratch
from trainer_core.data_sources import data_digest

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from trainer_core.data.records import DataSource
    from trainer_core.data.store import DocumentStore


def cached_or_staged(
    source: DataSource,
    digest: object,
    key: str,
    cache_dir: Path,
    tokenizer: Tokenizer,
    template: str | None,
    normalization: str,
) -> tuple[DocumentStore, bool]:
    """(the store, whether it came from the cache); a DataError when the files changed while they were read."""
    store = open_cached(cache_dir, key)
    if store is not None:
        return store, True
    store = stage_to_scratch(source, tokenizer, template, normalization)  # pyright: ignore[reportArgumentType]
    if data_digest(source.files) != digest:
        store.close()
        raise DataError(
            f"{source.files[0].key}: {', '.join(str(f.path) for f in source.files)} changed while it was read; run "
            "again once nothing writes to it any more"
        )
    return store, False
