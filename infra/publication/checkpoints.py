"""Read committed checkpoints, verifying them: list, verify, resolve LATEST, pull.

A checkpoint is visible only when its MANIFEST.json exists and verifies:
a known format (every earlier version is accepted), the run and step it is
stored under, paths that stay inside the checkpoint, and every file present
with its size and sha256. Three depths (see infra/store/objects.py for the
evidence each object carries):

- quick (the default; `rankflow checkpoints list/verify`, LATEST): one HEAD per
  object on S3, no download. Refused: a wrong size, a sha256 recorded at upload
  that is not the manifest's, a sha256 the store computed from its bytes that
  is not the manifest's, an ETag other than the one of the bytes uploaded (the
  object was rewritten since, metadata kept or not). An object with only a
  recorded digest and no evidence from the store is trusted. A local store
  hashes every file.
- confirm (`confirm=True`; the run's own "is this step committed" check, so a
  rerun repairs what does not pass): as quick, and any object that no digest
  of the store's own confirms is hashed (downloaded).
- full (`full=True`): every byte hashed.

A corrupt manifest or LATEST is reported and skipped, never trusted and never
an error for the rest of the run: `resolve_latest` falls back to the newest
checkpoint that verifies and says why.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from infra.publication.latest import latest_path, parse_latest
from infra.publication.manifests import (
    MANIFEST_FILE,
    CheckpointManifest,
    ManifestError,
    checkpoint_key,
    checkpoint_name,
    checkpoints_dir_key,
    parse_manifest,
    read_capped,
    retired_key,
    step_of,
)
from infra.publication.readers import reading
from infra.store.base import ObjectStore
from infra.store.conditional import read_versioned
from infra.store.durable import temp_name
from infra.store.objects import confirmed, list_files, object_problem
from infra.store.verified import fetch_verified

_BLOCK_BYTES = 4 * 2**20


@dataclass(frozen=True)
class CheckpointReport:
    """What a reader found for one checkpoint directory."""

    name: str
    step: int
    verified: bool
    problems: tuple[str, ...] = ()
    manifest: CheckpointManifest | None = None

    @property
    def num_files(self) -> int:
        return len(self.manifest.files) if self.manifest else 0

    @property
    def num_bytes(self) -> int:
        return self.manifest.num_bytes if self.manifest else 0

    def to_dict(self) -> dict:
        provenance = self.manifest.provenance if self.manifest else {}
        return {
            "checkpoint": self.name,
            "step": self.step,
            "verified": self.verified,
            "problems": list(self.problems),
            "num_files": self.num_files,
            "num_bytes": self.num_bytes,
            "format": provenance.get("format"),
            "provenance": {k: v for k, v in provenance.items() if k != "format"},
        }


@dataclass(frozen=True)
class LatestResolution:
    checkpoint: str | None
    """The newest checkpoint that verifies, as LATEST names it or by fallback; None if none does."""
    pointer: str | None
    """What LATEST itself says (None: absent or unreadable)."""
    fell_back: bool = False
    message: str | None = None
    """Why the pointer was not used, for the user."""
    reports: list[CheckpointReport] = field(default_factory=list)


def _base(store: ObjectStore, run_id: str, name: str) -> str:
    return store.path(checkpoint_key(run_id, name))


def checkpoint_names(store: ObjectStore, run_id: str) -> list[str]:
    """Names of the checkpoint directories of a run (with or without a manifest), oldest first."""
    names = store.children(checkpoints_dir_key(run_id), dirs_only=True)
    steps = {name: step for name in names if (step := step_of(name)) is not None}
    return sorted(steps, key=steps.__getitem__)


def read_manifest(store: ObjectStore, run_id: str, name: str) -> CheckpointManifest | None:
    """The checkpoint's manifest if it is there and valid; ManifestError if it is there and not."""
    path = f"{_base(store, run_id, name)}/{MANIFEST_FILE}"
    found = read_capped(store, store.key_of(path), path)
    if found is None:
        return None
    return parse_manifest(found, path, run_id=run_id, step=step_of(name))


def _hash_object(store: ObjectStore, path: str) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    with store.open_read(store.key_of(path)) as handle:
        while block := handle.read(_BLOCK_BYTES):
            digest.update(block)
            size += len(block)
    return size, digest.hexdigest()


def verify_checkpoint(
    store: ObjectStore, run_id: str, name: str, *, full: bool = False, confirm: bool = False
) -> CheckpointReport:
    """Check one checkpoint: quick, `confirm` (hash what the store's own digests do not confirm) or `full`."""
    step = step_of(name)
    if step is None:
        return CheckpointReport(name, -1, False, (f"{name!r} is not a checkpoint name (step-NNNNNNNN)",))
    with store.errors(f"verification of {name} of run {run_id}"):
        try:
            manifest = read_manifest(store, run_id, name)
        except ManifestError as error:
            return CheckpointReport(name, step, False, (f"manifest refused: {error}",))
        if manifest is None:
            return CheckpointReport(
                name, step, False, ("no manifest: not committed (or an orphan of a crashed commit)",)
            )
        base = _base(store, run_id, name)
        problems = []
        found = store.remote_objects(base, list(manifest.files), deadline=None)
        for entry in manifest.files:
            there = found.get(entry.path)
            problem = object_problem(there, entry)
            # A local store hashed the file already (`there.hashed`): that is the full check.
            if (
                problem is None
                and there is not None
                and ((full and not there.hashed) or (confirm and not confirmed(there, entry)))
            ):
                size, digest = _hash_object(store, f"{base}/{entry.path}")
                if (size, digest) != (entry.size, entry.sha256):
                    problem = f"sha256 {digest} does not match the manifest's {entry.sha256}"
            if problem is not None:
                problems.append(f"{entry.path}: {problem}")
    return CheckpointReport(name, step, not problems, tuple(problems), manifest)


def scan_checkpoints(store: ObjectStore, run_id: str, *, full: bool = False) -> list[CheckpointReport]:
    """A report for every checkpoint directory of the run that holds anything, oldest first.

    A directory with no manifest and no object is nothing: a local disk and
    SeaweedFS keep a directory whose objects were removed (by gc, or by hand).
    """
    reports = []
    for name in checkpoint_names(store, run_id):
        report = verify_checkpoint(store, run_id, name, full=full)
        if report.manifest is None and report.step >= 0 and _holds_nothing(store, run_id, name):
            continue
        reports.append(report)
    return reports


def _holds_nothing(store: ObjectStore, run_id: str, name: str) -> bool:
    with store.errors(f"listing of {name} of run {run_id}"):
        return not list_files(store, _base(store, run_id, name))


def list_checkpoints(store: ObjectStore, run_id: str) -> list[str]:
    """Names of the checkpoints of a run that verify (quick), oldest first; others are skipped."""
    return [report.name for report in scan_checkpoints(store, run_id) if report.verified]


def resolve_latest(store: ObjectStore, run_id: str, *, full: bool = False) -> LatestResolution:
    """The checkpoint LATEST names if it verifies, else the newest that does — and why."""
    with store.errors(f"LATEST of run {run_id}"):
        current = read_versioned(store, latest_path(store, run_id))
    pointer, problem = (None, None) if current is None else parse_latest(current.data)
    if pointer is not None:
        report = verify_checkpoint(store, run_id, pointer.checkpoint, full=full)
        if report.verified:
            return LatestResolution(pointer.checkpoint, pointer.checkpoint, reports=[report])
        problem = f"it points at {pointer.checkpoint}, which does not verify ({'; '.join(report.problems)})"
    reports = scan_checkpoints(store, run_id, full=full)
    verified = [r for r in reports if r.verified]
    newest = verified[-1].name if verified else None
    if current is None and problem is None:
        message = None if newest is None else f"LATEST is missing; using the newest verified checkpoint {newest}"
    else:
        message = f"LATEST is not usable ({problem}); " + (
            f"falling back to the newest verified checkpoint {newest}" if newest else "no checkpoint verifies"
        )
    return LatestResolution(
        newest,
        pointer.checkpoint if pointer else None,
        fell_back=newest is not None and message is not None,
        message=message,
        reports=reports,
    )


def latest_checkpoint(store: ObjectStore, run_id: str) -> str | None:
    """The newest checkpoint to use: LATEST's if it verifies, else the newest that does."""
    return resolve_latest(store, run_id).checkpoint


def download_checkpoint(store: ObjectStore, run_id: str, name: str, dest: Path) -> Path:
    """Download a committed checkpoint into `dest`, verifying every file's size and sha256.

    Files are written into a temporary directory beside `dest` and moved into
    place only when all of them verify; a manifest path can never leave it.
    """
    # The reader marker comes before the manifest is read: retention never removes what a marked reader saw.
    with reading(store, run_id, name), store.errors(f"download of {name} of run {run_id}"):
        base = _base(store, run_id, name)
        # Read once: what was read is what is verified.
        stored = read_capped(store, store.key_of(f"{base}/{MANIFEST_FILE}"), f"{base}/{MANIFEST_FILE}")
        if stored is None:
            removed = store.get(retired_key(run_id, step_of(name) or 0)) is not None
            raise FileNotFoundError(
                f"checkpoint {name} of run {run_id} has no manifest at {store.url}; "
                + ("retention removed it (storage.keep_last)" if removed else "it is not committed")
            )
        manifest = parse_manifest(stored, f"{base}/{MANIFEST_FILE}", run_id=run_id, step=step_of(name))
        dest = Path(dest)
        if dest.exists() and not (dest.is_dir() and not any(dest.iterdir())):
            raise FileExistsError(f"{dest} exists and is not an empty directory; pull into a new or empty directory")
        staging = temp_name(dest)
        staging.mkdir(parents=True)
        try:
            root = staging.resolve()
            for entry in manifest.files:
                target = staging / entry.path
                if root not in target.resolve().parents:  # parse_manifest refused this already; belt and braces
                    raise ManifestError(f"{base}/{MANIFEST_FILE}: {entry.path} leaves the checkpoint")
                fetch_verified(store, f"{base}/{entry.path}", target, entry)
            (staging / MANIFEST_FILE).write_bytes(stored)
            if dest.is_dir() and not any(dest.iterdir()):
                dest.rmdir()
            os.replace(staging, dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return dest


def pull_checkpoint(
    store: ObjectStore, run_id: str, dest: Path, step: int | None = None
) -> tuple[str, Path, str | None]:
    """Download checkpoint `step` (default: the newest verified); returns (name, path, note)."""
    if step is not None:
        return checkpoint_name(step), download_checkpoint(store, run_id, checkpoint_name(step), dest), None
    for attempt in range(2):
        resolution = resolve_latest(store, run_id)
        if resolution.checkpoint is None:
            raise FileNotFoundError(
                f"run {run_id} has no checkpoint that verifies at {store.url}"
                + (f" ({resolution.message})" if resolution.message else "")
            )
        try:
            return (
                resolution.checkpoint,
                download_checkpoint(store, run_id, resolution.checkpoint, dest),
                resolution.message,
            )
        except FileNotFoundError:
            # A newer commit moved LATEST and retention removed this one before our marker was up: resolve again.
            if attempt:
                raise
    raise AssertionError("unreachable")
