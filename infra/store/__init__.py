"""Object storage: the `ObjectStore` protocol, its backends, and the operations built on them.

`open_store` is the one constructor: it picks the backend for a
`storage.url` scheme from `BACKENDS` (adding a backend is one file, one line
there and its scheme in trainer_core/registry_names.py). Layers, each
importing only those above it (no cycle, function-local imports included):

- durable.py (crash-safe local writes), uploads.py (the metadata an uploaded
  object carries and what that evidence proves), base.py (the protocol, the
  limits `StoreTimeouts` and `Deadline`, error translation);
- conditional.py (a conditional write whose answer was lost is confirmed; the
  probe that refuses a store ignoring conditions), preflight.py (the
  writability probe and its error classes), local_tree.py (links and
  leftovers of a local store), s3_uploads.py (S3's verified uploads),
  verified.py (checked downloads);
- the backends: local.py, s3.py, memory.py;
- objects.py (remote digests, uploads, listing and removal over full store
  paths, on any backend) and lease.py (the leases LATEST and the run rely on).
"""

from __future__ import annotations

from typing import Protocol

from trainer_core.registry_names import STORE_SCHEMES, check_names

from .base import (
    Deadline,
    ObjectInfo,
    ObjectStore,
    PutMode,
    StorageSettings,
    StorageTimeoutError,
    StoreLocation,
    StoreTimeouts,
    Versioned,
)
from .local import LocalStore
from .memory import MemoryStore
from .s3 import S3Store
from .uploads import Upload


class Backend(Protocol):
    """A backend class: what `open_store` calls to open a store at a URL of its scheme."""

    def open(self, url: str, timeouts: StoreTimeouts) -> ObjectStore:
        """The store at `url`, its requests bounded by `timeouts`."""
        ...


BACKENDS: dict[str, Backend] = {"file": LocalStore, "s3": S3Store}
"""storage.url scheme → backend (a URL with no scheme is a local path). MemoryStore is built directly by tests.

The config's choices of scheme are `STORE_SCHEMES` (trainer_core/registry_names.py, torch-free), checked here."""
check_names("storage.url", STORE_SCHEMES, BACKENDS)


def open_store(storage: str | StorageSettings, timeouts: StoreTimeouts | None = None) -> ObjectStore:
    """The store for a `storage.url` or a storage section (`StorageSettings`): `s3://bucket/prefix`,
    `file://path` or a path. A section brings its request limits (`StoreTimeouts.from_settings`)."""
    if isinstance(storage, str):
        url = storage
    else:
        url = storage.url
        timeouts = timeouts or StoreTimeouts.from_settings(storage)
    timeouts = timeouts or StoreTimeouts()
    scheme, separator, _ = url.partition("://")
    # Anything else is a local path, as it always was (the config accepts file and s3 URLs only).
    backend = BACKENDS.get(scheme, LocalStore) if separator else LocalStore
    return backend.open(url, timeouts)


__all__ = [
    "BACKENDS",
    "Deadline",
    "LocalStore",
    "MemoryStore",
    "ObjectInfo",
    "ObjectStore",
    "PutMode",
    "S3Store",
    "StorageSettings",
    "StorageTimeoutError",
    "StoreLocation",
    "StoreTimeouts",
    "Upload",
    "Versioned",
    "open_store",
]
