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

from trainer_core.run.manifest import (
    FORMAT_V1,
    FORMAT_V2,
    MANIFEST_FILE,
    MANIFEST_PROBLEMS,
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

__all__ = [
    "CHECKPOINTS_DIR",
    "FORMAT_V1",
    "FORMAT_V2",
    "LATEST_FILE",
    "MANIFEST_FILE",
    "MANIFEST_PROBLEMS",
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
