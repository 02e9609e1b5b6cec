"""The object operations a publication needs: digests without downloads, verified concurrent uploads.

- `remote_objects` finds which of a checkpoint's objects are already in the
  store with the right size *and* sha256. On S3 the digest travels with the
  object (`x-amz-meta-sha256`, written at upload), so one HEAD per object
  answers it: a recommit never downloads an object to check it. On a local
  store the file is hashed where it lies.
- `upload_files` uploads many files at once (a thread pool locally, one
  asyncio batch on s3fs's loop, multipart for large files). A staged file
  whose bytes no longer match its manifest raises StagedFileChanged instead
  of being published. Each single-request upload carries the manifest's
  sha256 as `x-amz-checksum-sha256`: a server that verifies it (probed once
  per endpoint; SeaweedFS and AWS do) refuses other bytes, so the client need
  not hash them again; otherwise, and for multipart uploads, the client
  hashes the bytes as it reads them.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import posixpath
import secrets
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from .durable import temp_name
from .manifests import FileEntry
from .storage import Deadline, StoreLocation, run_async

SHA256_METADATA_KEY = "sha256"
MULTIPART_THRESHOLD_BYTES = 64 * 2**20
PART_SIZE_BYTES = 16 * 2**20
_BLOCK_BYTES = 4 * 2**20


class StagedFileChanged(ValueError):
    """A staged file's bytes no longer match its manifest: the export must be redone, not uploaded."""


@dataclass(frozen=True)
class RemoteObject:
    size: int
    sha256: str | None
    """The digest recorded with the object (None: uploaded without one, so unknown)."""


def _changed(local: Path, entry: FileEntry, digest: str, size: int) -> StagedFileChanged:
    return StagedFileChanged(
        f"staged file {local} no longer matches its manifest (size {size} vs {entry.size}, sha256 {digest[:12]}… vs "
        f"{entry.sha256[:12]}…); the export is re-done, not uploaded"
    )


# -- what is already there ----------------------------------------------------

def remote_objects(store: StoreLocation, base: str, entries: list[FileEntry], deadline: Deadline | None,
                   concurrency: int = 16) -> dict[str, RemoteObject]:
    """The entries present under `base`, with their size and recorded digest."""
    if store.is_local:
        found = {}
        for entry in entries:
            path = Path(base, entry.path)
            if path.is_file():
                size = path.stat().st_size
                # Only hash what could match; a wrong size is a mismatch already.
                found[entry.path] = RemoteObject(size, _sha256_file(path) if size == entry.size else None)
        return found

    async def head_all() -> dict[str, RemoteObject]:
        limit = asyncio.Semaphore(concurrency)

        async def head(entry: FileEntry) -> tuple[str, RemoteObject | None]:
            bucket, key = store.bucket_and_key(f"{base}/{entry.path}")
            async with limit:
                try:
                    response = await store.fs._call_s3("head_object", Bucket=bucket, Key=key)
                except FileNotFoundError:
                    return entry.path, None
            metadata = {k.lower(): v for k, v in (response.get("Metadata") or {}).items()}
            return entry.path, RemoteObject(int(response["ContentLength"]), metadata.get(SHA256_METADATA_KEY))

        pairs = await asyncio.gather(*(head(entry) for entry in entries))
        return {path: found for path, found in pairs if found is not None}

    return run_async(store, deadline, head_all)


def matches(found: RemoteObject | None, entry: FileEntry) -> bool:
    return found is not None and found.size == entry.size and found.sha256 == entry.sha256


# -- uploads -----------------------------------------------------------------

def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _read_verified(local: Path, entry: FileEntry, hash_locally: bool) -> bytes:
    data = local.read_bytes()
    if len(data) != entry.size:
        raise _changed(local, entry, "(not hashed)", len(data))
    if hash_locally:
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry.sha256:
            raise _changed(local, entry, digest, len(data))
    return data


_CHECKSUM_MISMATCH_CODES = ("BadDigest", "XAmzContentChecksumMismatch", "InvalidDigest")
# Endpoints seen to refuse a PutObject whose bytes do not match its x-amz-checksum-sha256 (or not).
_VERIFYING_ENDPOINTS: dict[str | None, bool] = {}
_PROBE_LOCK = threading.Lock()


def _checksum_mismatch(error: BaseException) -> bool:
    cause = error.__cause__ if error.__cause__ is not None else error
    return (getattr(cause, "response", None) or {}).get("Error", {}).get("Code") in _CHECKSUM_MISMATCH_CODES


def server_verifies_checksums(store: StoreLocation, probe_prefix: str) -> bool:
    """Whether the S3 server refuses bytes that do not match their x-amz-checksum-sha256 (probed once)."""
    endpoint = getattr(store.fs, "endpoint_url", None)
    with _PROBE_LOCK:
        if endpoint in _VERIFYING_ENDPOINTS:
            return _VERIFYING_ENDPOINTS[endpoint]
    bucket, key = store.bucket_and_key(f"{probe_prefix.rstrip('/')}/.checksum-probe-{secrets.token_hex(8)}")
    wrong = base64.b64encode(hashlib.sha256(b"expected").digest()).decode()
    try:
        store.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=b"received", ChecksumSHA256=wrong)
    except OSError as error:
        if not _checksum_mismatch(error):
            raise
        verifies = True
    else:
        store.fs.call_s3("delete_object", Bucket=bucket, Key=key)
        verifies = False
    with _PROBE_LOCK:
        _VERIFYING_ENDPOINTS[endpoint] = verifies
    return verifies


def upload_files(store: StoreLocation, staged_dir: Path, base: str, entries: list[FileEntry],
                 deadline: Deadline | None, on_uploaded: Callable[[FileEntry], None], concurrency: int = 8) -> None:
    """Upload `entries` from `staged_dir` to `base`, concurrently; `on_uploaded` runs as each one lands."""
    if not entries:
        return
    if store.is_local:
        _upload_local(staged_dir, base, entries, deadline, on_uploaded, concurrency)
    else:
        hash_locally = not server_verifies_checksums(store, base)
        run_async(store, deadline, _upload_s3, store, staged_dir, base, entries, on_uploaded, concurrency,
                  hash_locally)


def _upload_local(staged_dir: Path, base: str, entries: list[FileEntry], deadline: Deadline | None,
                  on_uploaded: Callable[[FileEntry], None], concurrency: int) -> None:
    def copy(entry: FileEntry) -> FileEntry:
        if deadline is not None:
            deadline.remaining()
        local, target = staged_dir / entry.path, Path(base, entry.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_name(target)
        digest, size = hashlib.sha256(), 0
        try:
            with local.open("rb") as source, tmp.open("wb") as sink:
                while block := source.read(_BLOCK_BYTES):
                    digest.update(block)
                    size += len(block)
                    sink.write(block)
                sink.flush()
                os.fsync(sink.fileno())
            if size != entry.size or digest.hexdigest() != entry.sha256:
                raise _changed(local, entry, digest.hexdigest(), size)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        return entry

    pool = ThreadPoolExecutor(max_workers=concurrency)
    futures = [pool.submit(copy, entry) for entry in sorted(entries, key=lambda e: -e.size)]
    try:
        for future in as_completed(futures):
            on_uploaded(future.result())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # a failure stops the files not yet started


async def _upload_s3(store: StoreLocation, staged_dir: Path, base: str, entries: list[FileEntry],
                     on_uploaded: Callable[[FileEntry], None], concurrency: int, hash_locally: bool) -> None:
    fs = store.fs
    limit = asyncio.Semaphore(concurrency)
    record_lock = asyncio.Lock()

    async def upload(entry: FileEntry) -> None:
        local = staged_dir / entry.path
        bucket, key = store.bucket_and_key(f"{base}/{entry.path}")
        metadata = {SHA256_METADATA_KEY: entry.sha256}
        async with limit:
            if entry.size < MULTIPART_THRESHOLD_BYTES:
                data = await asyncio.to_thread(_read_verified, local, entry, hash_locally)
                checksum = base64.b64encode(bytes.fromhex(entry.sha256)).decode()
                try:
                    await fs._call_s3("put_object", Bucket=bucket, Key=key, Body=data, Metadata=metadata,
                                      ChecksumSHA256=checksum)
                except OSError as error:
                    if _checksum_mismatch(error):  # the server hashed the bytes: not the manifest's
                        raise _changed(local, entry, "(refused by the server's sha256 check)", len(data)) from error
                    raise
            else:
                await _multipart(fs, bucket, key, local, entry, metadata)
        async with record_lock:  # the journal is written by one upload at a time
            await asyncio.to_thread(on_uploaded, entry)

    await asyncio.gather(*(upload(entry) for entry in sorted(entries, key=lambda e: -e.size)))


async def _multipart(fs, bucket: str, key: str, local: Path, entry: FileEntry, metadata: dict) -> None:
    """Upload a large file in parts, hashing as it reads; abort the upload if the bytes do not match."""
    started = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key, Metadata=metadata)
    upload_id = started["UploadId"]
    digest, size, parts, pending = hashlib.sha256(), 0, [], []
    try:
        with local.open("rb") as handle:
            part_number = 0
            while chunk := await asyncio.to_thread(handle.read, PART_SIZE_BYTES):
                part_number += 1
                await asyncio.to_thread(digest.update, chunk)
                size += len(chunk)
                pending.append(asyncio.ensure_future(fs._call_s3(
                    "upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=part_number, Body=chunk)))
                if len(pending) >= 4:  # at most four parts of one file in flight
                    await asyncio.gather(*pending)
                    parts.extend(pending)
                    pending = []
            await asyncio.gather(*pending)
            parts.extend(pending)
        if size != entry.size or digest.hexdigest() != entry.sha256:
            raise _changed(local, entry, digest.hexdigest(), size)
        await fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={
            "Parts": [{"PartNumber": i, "ETag": part.result()["ETag"]} for i, part in enumerate(parts, 1)]})
    except BaseException:
        for part in pending:
            part.cancel()
        try:
            await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception:  # noqa: BLE001 - the store may be gone; cleanup aborts it later
            pass
        raise


# -- small objects, removal, dangling uploads ---------------------------------------

def put_small(store: StoreLocation, path: str, data: bytes, deadline: Deadline | None = None) -> None:
    """Write a small object whole (atomically), with its digest recorded like any uploaded file."""
    digest = hashlib.sha256(data).hexdigest()
    if store.is_local:
        from .durable import write_durable

        write_durable(Path(path), data)
        return
    bucket, key = store.bucket_and_key(path)
    checksum = base64.b64encode(bytes.fromhex(digest)).decode()
    run_async(store, deadline, store.fs._call_s3, "put_object", Bucket=bucket, Key=key, Body=data,
              Metadata={SHA256_METADATA_KEY: digest}, ChecksumSHA256=checksum)


def list_files(store: StoreLocation, base: str) -> dict[str, int]:
    """Every object under `base/` (relative path → size); empty if there is none.

    In a local store a symbolic link is not an object: it is neither listed
    nor descended into, so nothing reached through one is ever removed.
    """
    prefix = base.rstrip("/") + "/"
    try:
        found = store.fs.find(prefix, detail=True)
    except FileNotFoundError:
        return {}
    return {path.removeprefix(prefix): int(info.get("size") or 0) for path, info in found.items()
            if path.startswith(prefix) and info.get("type", "file") != "directory" and not info.get("islink")}


def list_links(store: StoreLocation, base: str) -> dict[str, str]:
    """The symbolic links under `base/` of a local store (relative path → target); none on S3."""
    if not store.is_local:
        return {}
    prefix = base.rstrip("/") + "/"
    try:
        found = store.fs.find(prefix, detail=True)
    except FileNotFoundError:
        return {}
    return {path.removeprefix(prefix): os.readlink(path) for path, info in found.items()
            if path.startswith(prefix) and info.get("islink")}


def outside_store(store: StoreLocation, path: str) -> str | None:
    """Where `path` of a local store really is when a symbolic link takes it out of the store's root, else None."""
    if not store.is_local:
        return None
    root, real = os.path.realpath(store.root), os.path.realpath(path)
    return None if real == root or real.startswith(root.rstrip(os.sep) + os.sep) else real


def _refuse_outside(store: StoreLocation, path: str, directory: str) -> None:
    escaped = outside_store(store, directory)
    if escaped is not None:
        raise PermissionError(f"refusing to remove {path}: through a symbolic link it lies in {escaped}, outside the "
                              f"store {store.root}; nothing is removed outside a store — remove the link by hand")


def remove_files(store: StoreLocation, base: str, relative_paths: list[str]) -> None:
    """Remove objects under `base/`; in a local store never through a link out of the store (a link itself may go)."""
    if not relative_paths:
        return
    paths = [f"{base.rstrip('/')}/{p}" for p in relative_paths]
    if store.is_local:
        for path in paths:  # all checked before any is removed
            _refuse_outside(store, path, os.path.dirname(path))
        for path in paths:
            Path(path).unlink(missing_ok=True)
        return
    store.fs.rm(paths)


def remove_empty_directories(store: StoreLocation, base: str, relative_paths: list[str]) -> None:
    """Remove `base/` and the directories of `relative_paths` under it once nothing is left in them.

    Both a local disk and SeaweedFS keep a directory after its last object is
    removed, and a reader would list it as a checkpoint. On S3 the directory
    is its key with a trailing '/' (deleting it is a no-op where the store
    has no such entry, as on AWS); it is deleted only after a fresh listing
    finds no object left under `base/`.
    """
    base = base.rstrip("/")
    directories = {base} | {posixpath.join(base, posixpath.dirname(p)) for p in relative_paths if "/" in p}
    for path in list(directories):
        while path != base:  # every ancestor up to base
            directories.add(path)
            path = posixpath.dirname(path)
    deepest_first = sorted(directories, key=lambda d: d.count("/"), reverse=True)
    if store.is_local:
        _refuse_outside(store, base, base)
        for directory in deepest_first:
            try:
                os.rmdir(directory)  # only when empty; never a link (ENOTDIR)
            except OSError:
                continue
        return
    if list_files(store, base):
        return  # something landed there since: a directory with objects is never removed
    for directory in deepest_first:
        bucket, key = store.bucket_and_key(directory + "/")
        store.fs.call_s3("delete_object", Bucket=bucket, Key=key)
    store.fs.invalidate_cache(base)


def remove_tree(store: StoreLocation, base: str) -> None:
    if store.is_local:
        _refuse_outside(store, base, base)
        shutil.rmtree(base, ignore_errors=True)  # rmtree unlinks the links it meets, never follows them
        return
    files = list_files(store, base)
    remove_files(store, base, sorted(files))


def abort_dangling_uploads(store: StoreLocation, prefix: str) -> int:
    """Abort unfinished multipart uploads whose key lies under `prefix/` (S3 only); how many."""
    if store.is_local:
        return 0
    bucket, key_prefix = store.bucket_and_key(prefix.rstrip("/") + "/")
    aborted = 0
    # A paginated listing narrowed to the prefix: uploads of other runs, or of
    # other checkpoints of this run, are never even looked at.
    token: dict = {}
    while True:
        page = store.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key_prefix, **token)
        for upload in page.get("Uploads", []):
            if upload["Key"].startswith(key_prefix):
                store.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                aborted += 1
        if not page.get("IsTruncated"):
            return aborted
        token = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}
