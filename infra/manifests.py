"""Checkpoint layout in the store and the manifests that make checkpoints visible.

    RUN_ID/checkpoints/step-00000060/{files…, MANIFEST.json}
    RUN_ID/LATEST                       {"checkpoint": "step-00000060", "step": 60}
    RUN_ID/publications/step-00000060.json   the publication's journal (mirror)
    RUN_ID/leases/finalizer.json        the run's finalizer lease

The manifest format is written once, in trainer_core/manifest.py (the export
writes it, infra reads it): `CheckpointManifest` and `FileEntry` are re-exported
here with `parse_manifest`, which trusts a manifest only after checking its
format version, the run and step it is stored under, and file paths that stay
inside their checkpoint.
"""

from __future__ import annotations

from trainer_core.manifest import (
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
    "CHECKPOINTS_DIR", "FORMAT_V1", "FORMAT_V2", "LATEST_FILE", "MANIFEST_FILE", "MANIFEST_PROBLEMS",
    "PUBLICATIONS_DIR", "SUPPORTED_FORMATS", "CheckpointManifest", "FileEntry", "FileList", "ManifestError",
    "Sha256", "checkpoint_name", "decode", "parse_manifest", "refusal", "step_of",
]

LATEST_FILE = "LATEST"
CHECKPOINTS_DIR = "checkpoints"
PUBLICATIONS_DIR = "publications"
