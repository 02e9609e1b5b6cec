"""Checkpoint layout in the store and the manifests that make checkpoints visible.

    RUN_ID/checkpoints/step-00000060/{files…, MANIFEST.json}
    RUN_ID/LATEST                       {"checkpoint": "step-00000060", "step": 60}
    RUN_ID/publications/step-00000060.json   the publication's journal (mirror)
    RUN_ID/finalizer-queue/step-00000060.json   a committer waiting for the finalizer
    RUN_ID/leases/finalizer.json        the run's finalizer lease (`lease_key`, infra/store/lease.py)
    RUN_ID/retired/step-00000020.json   a checkpoint retention removed (infra/publication/retention.py)
    RUN_ID/readers/step-00000060/ID.json   a reader pulling the checkpoint (infra/publication/readers.py)

The keys (relative to the store's root: `store.path(key)`, `store.url_of(key)`)
are written once, by the functions below; nothing else spells this layout.

The manifest format is written once, in trainer_core/run/manifest.py (the export
writes it, infra reads it): `CheckpointManifest` and `FileEntry` are re-exported
here with `parse_manifest`, which trusts a manifest only after checking its
format version, the run and step it is stored under, and file paths that stay
inside their checkpoint.
"""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING

from trainer_core.run.manifest import (
    FORMAT_V1,
    FORMAT_V2,
    MANIFEST_FILE,
    MANIFEST_PROBLEMS,
    MAX_MANIFEST_BYTES,
    SUPPORTED_FORMATS,
    CheckpointManifest,
    FileEntry,
    FileList,
    ManifestError,
    Sha256,
    checkpoint_name,
    decode,
    parse_manifest,
    refusal,
    step_of,
)

if TYPE_CHECKING:
    from infra.store.base import ObjectStore

__all__ = [
    "CHECKPOINTS_DIR",
    "FORMAT_V1",
    "FORMAT_V2",
    "LATEST_FILE",
    "MANIFEST_FILE",
    "MANIFEST_PROBLEMS",
    "MAX_MANIFEST_BYTES",
    "PUBLICATIONS_DIR",
    "QUEUE_DIR",
    "READERS_DIR",
    "RETIRED_DIR",
    "SUPPORTED_FORMATS",
    "CheckpointManifest",
    "FileEntry",
    "FileList",
    "ManifestError",
    "Sha256",
    "checkpoint_key",
    "checkpoint_name",
    "checkpoints_dir_key",
    "decode",
    "journal_key",
    "latest_key",
    "parse_manifest",
    "publications_dir_key",
    "queue_dir_key",
    "queue_key",
    "read_capped",
    "reader_key",
    "readers_dir_key",
    "retired_key",
    "refusal",
    "step_of",
]

LATEST_FILE = "LATEST"
CHECKPOINTS_DIR = "checkpoints"
PUBLICATIONS_DIR = "publications"
QUEUE_DIR = "finalizer-queue"
RETIRED_DIR = "retired"
READERS_DIR = "readers"


def checkpoints_dir_key(run_id: str) -> str:
    return posixpath.join(run_id, CHECKPOINTS_DIR)


def checkpoint_key(run_id: str, name: str, *parts: str) -> str:
    """The checkpoint directory `name` (`step-NNNNNNNN`) of the run, or `parts` inside it."""
    return posixpath.join(run_id, CHECKPOINTS_DIR, name, *parts)


def latest_key(run_id: str) -> str:
    return posixpath.join(run_id, LATEST_FILE)


def publications_dir_key(run_id: str) -> str:
    return posixpath.join(run_id, PUBLICATIONS_DIR)


def journal_key(run_id: str, step: int) -> str:
    """The store's mirror of the journal of the publication of `step`."""
    return posixpath.join(run_id, PUBLICATIONS_DIR, f"{checkpoint_name(step)}.json")


def queue_dir_key(run_id: str) -> str:
    return posixpath.join(run_id, QUEUE_DIR)


def queue_key(run_id: str, step: int) -> str:
    """The finalizer-queue entry of the committer of `step`."""
    return posixpath.join(run_id, QUEUE_DIR, f"{checkpoint_name(step)}.json")


def retired_key(run_id: str, step: int) -> str:
    """The record that retention removed the checkpoint of `step` (written before its manifest goes)."""
    return posixpath.join(run_id, RETIRED_DIR, f"{checkpoint_name(step)}.json")


def readers_dir_key(run_id: str, name: str) -> str:
    """The markers of the readers pulling checkpoint `name`."""
    return posixpath.join(run_id, READERS_DIR, name)


def reader_key(run_id: str, name: str, reader_id: str) -> str:
    return posixpath.join(run_id, READERS_DIR, name, f"{reader_id}.json")


def read_capped(store: ObjectStore, key: str, where: str, limit_bytes: int = MAX_MANIFEST_BYTES) -> bytes | None:
    """The bytes of the small record stored at `key` (a manifest, by default), or None when there is none.

    A record larger than `limit_bytes` is refused (ManifestError naming `where`) by the size the store gives,
    before a byte of it is read: a hostile 100 MiB manifest costs one HEAD, not its size (and five times that to
    parse) in memory. One replaced by a larger one between the HEAD and the read is refused after the read.
    """
    found = store.head([key]).get(key)
    if found is None:
        return None
    if found.size > limit_bytes:
        raise _too_large(where, found.size, limit_bytes)
    stored = store.get(key)
    if stored is None:
        return None
    if len(stored.data) > limit_bytes:
        raise _too_large(where, len(stored.data), limit_bytes)
    return stored.data


def _too_large(where: str, size: int, limit_bytes: int) -> ManifestError:
    return ManifestError(
        f"{where}: {size} bytes, more than the {limit_bytes} a record of this kind may take; refusing it unread "
        "(a manifest that large was not written by rankflow: remove it, and the checkpoint or state is not there)"
    )
