"""Checkpoint layout in the store and the manifests that make checkpoints visible.

    RUN_ID/checkpoints/step-00000060/{files…, MANIFEST.json}
    RUN_ID/LATEST                       {"checkpoint": "step-00000060", "step": 60}
    RUN_ID/publications/step-00000060.json   the publication's journal (mirror)
    RUN_ID/leases/finalizer.json        the run's finalizer lease

A manifest is trusted only after `parse_manifest` accepts it: a known format
version (every earlier one stays readable), the run and step it is stored
under, and file paths that stay inside their checkpoint (no `..`, no absolute
path, no empty or odd segment) — a hostile manifest can neither make a reader
write outside its destination nor make a commit upload a host file.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

MANIFEST_FILE = "MANIFEST.json"
LATEST_FILE = "LATEST"
CHECKPOINTS_DIR = "checkpoints"
PUBLICATIONS_DIR = "publications"
FORMAT_V1 = "rankflow-checkpoint/1"
FORMAT_V2 = "rankflow-checkpoint/2"
SUPPORTED_FORMATS = (FORMAT_V1, FORMAT_V2)
"""Every manifest format this reader accepts, oldest first."""

_NAME = re.compile(r"^step-(\d{8,})$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SEGMENT = re.compile(r"^[A-Za-z0-9._+@=-][A-Za-z0-9._+@= -]*$")


class ManifestError(ValueError):
    """A manifest that must not be trusted; the message says which and why."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(name: str) -> int | None:
    """The step of a checkpoint name `step-NNNNNNNN`, or None for any other name."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def safe_relative_path(path: object, where: str) -> str:
    """`path` if it names a file inside its checkpoint; ManifestError otherwise."""
    if not isinstance(path, str) or not path:
        raise ManifestError(f"{where}: file path {path!r} is not a non-empty string")
    if path.startswith("/") or "\\" in path or "\x00" in path:
        raise ManifestError(f"{where}: file path {path!r} is absolute or not a POSIX relative path; refusing it")
    segments = path.split("/")
    for segment in segments:
        if segment in ("", ".", "..") or not _SEGMENT.match(segment):
            raise ManifestError(f"{where}: file path {path!r} leaves its checkpoint or has an odd segment "
                                f"({segment!r}); refusing the manifest")
    if path == MANIFEST_FILE:
        raise ManifestError(f"{where}: the manifest lists itself")
    return path


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    format: str
    run_id: str | None
    step: int
    files: tuple[FileEntry, ...]
    raw: dict

    @property
    def num_bytes(self) -> int:
        return sum(entry.size for entry in self.files)

    @property
    def provenance(self) -> dict:
        return {key: value for key, value in self.raw.items() if key != "files"}


def parse_manifest(data: bytes, where: str, *, run_id: str | None = None, step: int | None = None) -> Manifest:
    """Validate a manifest's bytes; `run_id`/`step` are where it was found (checked when given)."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as error:
        raise ManifestError(f"{where}: not valid JSON ({error})") from None
    if not isinstance(raw, dict):
        raise ManifestError(f"{where}: not a JSON object")
    version = raw.get("format")
    if version not in SUPPORTED_FORMATS:
        raise ManifestError(f"{where}: unknown format {version!r}; this reader knows {', '.join(SUPPORTED_FORMATS)} "
                            "(a newer rankflow wrote it? upgrade to read it)")
    manifest_step = raw.get("step")
    if not isinstance(manifest_step, int) or isinstance(manifest_step, bool) or manifest_step < 0:
        raise ManifestError(f"{where}: step {manifest_step!r} is not a non-negative integer")
    if step is not None and manifest_step != step:
        raise ManifestError(f"{where}: manifest of step {manifest_step} stored as step {step}; refusing it")
    manifest_run = raw.get("run_id")
    if manifest_run is not None and not isinstance(manifest_run, str):
        raise ManifestError(f"{where}: run_id {manifest_run!r} is not a string")
    if run_id is not None and manifest_run is not None and manifest_run != run_id:
        raise ManifestError(f"{where}: manifest of run {manifest_run!r} stored under run {run_id!r}; refusing it")
    if raw.get("format") == FORMAT_V2 and manifest_run is None:
        raise ManifestError(f"{where}: a {FORMAT_V2} manifest must name its run_id")
    entries = parse_file_entries(raw.get("files"), where)
    return Manifest(format=version, run_id=manifest_run, step=manifest_step, files=entries, raw=raw)


def parse_file_entries(files: object, where: str) -> tuple[FileEntry, ...]:
    """A manifest's `files` list, checked: safe relative paths, sizes, sha256 digests, no duplicates."""
    if not isinstance(files, list):
        raise ManifestError(f"{where}: 'files' is not a list")
    entries, seen = [], set()
    for index, entry in enumerate(files):
        if not isinstance(entry, dict):
            raise ManifestError(f"{where}: files[{index}] is not an object")
        path = safe_relative_path(entry.get("path"), where)
        size, digest = entry.get("size"), entry.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ManifestError(f"{where}: {path}: size {size!r} is not a non-negative integer")
        if not isinstance(digest, str) or not _SHA256.match(digest):
            raise ManifestError(f"{where}: {path}: sha256 {digest!r} is not 64 lowercase hex digits")
        if path in seen or any(other.startswith(path + "/") or path.startswith(other + "/") for other in seen):
            raise ManifestError(f"{where}: {path} is listed twice or is both a file and a directory")
        seen.add(path)
        entries.append(FileEntry(path, size, digest))
    return tuple(entries)
