"""Commit a staged checkpoint to object storage, and clean up after it.

Layout under `storage.url`:

    RUN_ID/checkpoints/step-00000060/{config.json, model*.safetensors, …, MANIFEST.json}
    RUN_ID/LATEST            {"checkpoint": "step-00000060", "step": 60}
    RUN_ID/ledger.jsonl      the run ledger

Commit uploads the data files first and the manifest last, then moves LATEST
forward (never back). A reader (infra/checkpoints.py) only lists checkpoints
whose manifest exists, so it never sees a partial one. A retried commit skips
objects that are already there with the right size. Cleanup removes the local
staging and aborts dangling multipart uploads; it never touches a committed
checkpoint.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .storage import StoreLocation, storage_errors, write_small_atomic

MANIFEST_FILE = "MANIFEST.json"
LATEST_FILE = "LATEST"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass(frozen=True)
class CommitOutcome:
    checkpoint_url: str
    step: int
    num_files_uploaded: int
    num_files_skipped: int
    bytes_uploaded: int
    latest_moved: bool
    wall_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def read_staged_manifest(staged_dir: Path) -> dict:
    path = staged_dir / MANIFEST_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{staged_dir} has no {MANIFEST_FILE}; the export did not finish — rerun the export stage")
    manifest = json.loads(path.read_text())
    for entry in manifest["files"]:
        file = staged_dir / entry["path"]
        if not file.is_file() or file.stat().st_size != entry["size"]:
            raise ValueError(f"staged file {file} does not match its manifest entry; rerun the export stage")
    return manifest


def _remote_sizes(store: StoreLocation, remote_dir: str) -> dict[str, int]:
    if not store.fs.exists(remote_dir):
        return {}
    found = store.fs.find(remote_dir, detail=True)
    prefix = remote_dir.rstrip("/") + "/"
    return {path.removeprefix(prefix): int(info["size"]) for path, info in found.items()}


def read_latest(store: StoreLocation, run_id: str) -> dict | None:
    path = store.path(run_id, LATEST_FILE)
    if not store.fs.exists(path):
        return None
    return json.loads(store.fs.cat_file(path))


def commit_checkpoint(staged_dir: Path, store: StoreLocation, run_id: str) -> CommitOutcome:
    """Upload a staged checkpoint: data files, then the manifest, then LATEST."""
    with storage_errors(store, f"commit of {staged_dir.name} for run {run_id}"):
        return _commit(staged_dir, store, run_id)


def _commit(staged_dir: Path, store: StoreLocation, run_id: str) -> CommitOutcome:
    started = time.perf_counter()
    manifest = read_staged_manifest(staged_dir)
    step = int(manifest["step"])
    name = checkpoint_name(step)
    remote_dir = store.path(run_id, "checkpoints", name)
    existing = _remote_sizes(store, remote_dir)
    uploaded = skipped = bytes_uploaded = 0
    for entry in manifest["files"]:
        if existing.get(entry["path"]) == entry["size"]:
            skipped += 1  # uploaded by an earlier try of this commit
            continue
        store.fs.put_file(str(staged_dir / entry["path"]), f"{remote_dir}/{entry['path']}")
        uploaded += 1
        bytes_uploaded += entry["size"]
    # The manifest goes last: its presence is what makes the checkpoint visible.
    write_small_atomic(store, f"{remote_dir}/{MANIFEST_FILE}", (staged_dir / MANIFEST_FILE).read_bytes())
    latest = read_latest(store, run_id)
    moved = latest is None or int(latest["step"]) < step
    if moved:
        write_small_atomic(store, store.path(run_id, LATEST_FILE), json.dumps({"checkpoint": name, "step": step}).encode())
    return CommitOutcome(
        checkpoint_url=store.url_of(run_id, "checkpoints", name), step=step,
        num_files_uploaded=uploaded, num_files_skipped=skipped, bytes_uploaded=bytes_uploaded,
        latest_moved=moved, wall_s=time.perf_counter() - started,
    )


def abort_dangling_uploads(store: StoreLocation, prefix: str) -> int:
    """Abort unfinished multipart uploads under `prefix` (S3 only); returns how many."""
    if store.is_local:
        return 0
    bucket, _, key_prefix = prefix.partition("/")
    aborted = 0
    for upload in store.fs.list_multipart_uploads(bucket):
        if upload["Key"].startswith(key_prefix):
            store.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
            aborted += 1
    return aborted


def cleanup_staging(staged_dir: Path, store: StoreLocation, run_id: str) -> dict:
    """Remove local staging of a committed checkpoint; never touches committed objects."""
    with storage_errors(store, f"cleanup of {staged_dir.name} for run {run_id}"):
        return _cleanup(staged_dir, store, run_id)


def _cleanup(staged_dir: Path, store: StoreLocation, run_id: str) -> dict:
    removed_bytes = 0
    if staged_dir.exists():
        removed_bytes = sum(p.stat().st_size for p in staged_dir.rglob("*") if p.is_file())
        shutil.rmtree(staged_dir)
    for leftover in (staged_dir.with_name(staged_dir.name + ".tmp"), staged_dir.with_name(staged_dir.name + ".result.json")):
        if leftover.is_dir():
            shutil.rmtree(leftover)
        elif leftover.exists():
            leftover.unlink()
    aborted = abort_dangling_uploads(store, store.path(run_id, "checkpoints"))
    return {"removed_bytes": removed_bytes, "aborted_uploads": aborted}
