"""The object operations a publication needs: digests without downloads, verified concurrent uploads.

- `remote_objects` says what the store holds for each of a checkpoint's
  objects: its size, the sha256 rankflow recorded with it at upload
  (`x-amz-meta-sha256`), and what the store itself computed from the bytes it
  holds: the sha256 checksum S3 keeps for a single-part object sent with
  `x-amz-checksum-sha256` (HEAD with checksum mode), and the ETag, compared
  with the ETag rankflow computed from the verified bytes it sent
  (`x-amz-meta-etag`: the MD5, or for a multipart upload the MD5 of the
  parts' MD5s). One HEAD per object, no download. On a local store the file
  is hashed where it lies.
- What that evidence proves (`object_problem`, `confirmed`): a recorded
  digest is only what was true at upload; bytes rewritten later keep their
  metadata. Only a digest the store computed from the bytes it holds (or a
  local hash) *confirms* an object; a recorded digest that disagrees, or an
  ETag other than the one recorded, *refutes* it. Uploads skip only what is
  confirmed (`matches`); readers' quick checks refuse what is refuted; the
  run's own "is it committed" check hashes what is not confirmed
  (infra/checkpoints.py).
- `upload_files` uploads many files at once (a thread pool locally, one
  asyncio batch on s3fs's loop, multipart for large files). A staged file
  whose bytes no longer match its manifest raises StagedFileChanged instead
  of being published. Each single-request upload carries the manifest's
  sha256 as `x-amz-checksum-sha256`: a server that verifies it (probed once
  per endpoint; SeaweedFS and AWS do) refuses other bytes and keeps the
  checksum, so the client need not hash them again; otherwise the client
  hashes them (sha256 against the manifest, MD5 recorded as the ETag). A multipart upload
  hashes the file first (sha256 against the manifest, MD5 per part) and sends
  each part with its `Content-MD5`, so the server refuses a part whose bytes
  changed since.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import posixpath
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from .durable import TEMP_MARKER, temp_name
from ..manifests import FileEntry
from .base import Deadline, StoreLocation, run_async

SHA256_METADATA_KEY = "sha256"
ETAG_METADATA_KEY = "etag"
"""Metadata: the ETag the store computes from the bytes rankflow verified and sent (a rewrite changes the real one)."""
CHECKSUM_METADATA_KEY = "checksum"
"""Metadata: "sha256" when the object was sent with an x-amz-checksum-sha256 that the server verified and keeps
(a rewrite without it leaves the object with no checksum: refuted at no hashing cost)."""
MULTIPART_THRESHOLD_BYTES = 64 * 2**20
PART_SIZE_BYTES = 16 * 2**20
_BLOCK_BYTES = 4 * 2**20


class StagedFileChanged(ValueError):
    """A staged file's bytes no longer match its manifest: the export must be redone, not uploaded."""


@dataclass(frozen=True)
class RemoteObject:
    size: int
    sha256: str | None
    """The digest recorded with the object at upload (None: uploaded without one); on a local store, its bytes' own."""
    hashed: bool = False
    """`sha256` was computed here from the bytes the store holds (a local store), not read from a record."""
    server_sha256: str | None = None
    """The sha256 the store computed from the bytes it holds (S3's full-object ChecksumSHA256), hex."""
    etag: str | None = None
    """The store's ETag of the bytes it holds."""
    recorded_etag: str | None = None
    """The ETag rankflow computed from the bytes it verified and uploaded (metadata)."""
    checksum_kept: bool = False
    """rankflow sent the object with a sha256 checksum the server verified and keeps (metadata)."""


def _changed(local: Path, entry: FileEntry, digest: str, size: int) -> StagedFileChanged:
    return StagedFileChanged(
        f"staged file {local} no longer matches its manifest (size {size} vs {entry.size}, sha256 {digest[:12]}… vs "
        f"{entry.sha256[:12]}…); the export is re-done, not uploaded"
    )


# -- what is already there ----------------------------------------------------

def remote_objects(store: StoreLocation, base: str, entries: list[FileEntry], deadline: Deadline | None,
                   concurrency: int = 16) -> dict[str, RemoteObject]:
    """The entries present under `base`, with their size and recorded digest."""
    if not _is_s3(store):
        # A store that hashes the bytes where they lie (a local disk, memory): its digest is the bytes' own.
        by_key = {store.key_of(f"{base}/{entry.path}"): entry for entry in entries}
        found = {}
        for key, info in store.head(list(by_key), deadline=deadline).items():
            entry = by_key[key]
            # Only hash what could match (the digest is computed when first read); a wrong size is a mismatch already.
            same_size = info.size == entry.size
            found[entry.path] = RemoteObject(info.size, info.sha256 if same_size else None, hashed=same_size)
        return found

    async def head_all() -> dict[str, RemoteObject]:
        limit = asyncio.Semaphore(concurrency)

        async def head(entry: FileEntry) -> tuple[str, RemoteObject | None]:
            bucket, key = store.bucket_and_key(f"{base}/{entry.path}")
            async with limit:
                try:
                    # Checksum mode: S3 returns the checksum it stored for the object's bytes.
                    response = await store._request("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED")
                except FileNotFoundError:
                    return entry.path, None
            return entry.path, _remote_object(response)

        pairs = await asyncio.gather(*(head(entry) for entry in entries))
        return {path: found for path, found in pairs if found is not None}

    return run_async(store, deadline, head_all)


def _is_s3(store: StoreLocation) -> bool:
    from .s3 import S3Store

    return isinstance(store, S3Store)


def _remote_object(response: dict) -> RemoteObject:
    metadata = {k.lower(): v for k, v in (response.get("Metadata") or {}).items()}
    checksum = response.get("ChecksumSHA256")
    server_sha256 = None
    # A multipart object's checksum is of its parts' checksums ("…-N", type COMPOSITE): not the file's sha256.
    if checksum and "-" not in checksum and response.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT":
        try:
            server_sha256 = base64.b64decode(checksum, validate=True).hex()
        except ValueError:
            server_sha256 = None
    etag = (response.get("ETag") or "").strip('"') or None
    return RemoteObject(int(response["ContentLength"]), metadata.get(SHA256_METADATA_KEY), server_sha256=server_sha256,
                        etag=etag, recorded_etag=metadata.get(ETAG_METADATA_KEY),
                        checksum_kept=metadata.get(CHECKSUM_METADATA_KEY) == "sha256")


def object_problem(found: RemoteObject | None, entry: FileEntry) -> str | None:
    """Why the stored object is not `entry`'s bytes, by what the store says of it; None when nothing refutes it."""
    if found is None:
        return "missing"
    if found.size != entry.size:
        return f"size {found.size}, manifest says {entry.size}"
    if found.hashed:
        return None if found.sha256 == entry.sha256 else \
            f"sha256 {found.sha256} does not match the manifest's {entry.sha256}"
    if found.server_sha256 is not None and found.server_sha256 != entry.sha256:
        return (f"the store's own sha256 of its bytes, {found.server_sha256}, does not match the manifest's "
                f"{entry.sha256}")
    if found.sha256 is not None and found.sha256 != entry.sha256:
        return f"recorded sha256 {found.sha256} does not match the manifest's"
    if found.server_sha256 is None and found.checksum_kept:
        return ("it was uploaded with its sha256 checksum, which the store no longer holds: the object was rewritten "
                "since")
    if found.server_sha256 is None and found.recorded_etag is not None and found.etag != found.recorded_etag:
        return (f"its ETag {found.etag} is not {found.recorded_etag}, the ETag of the bytes uploaded: the object was "
                "rewritten since (on a store whose ETags are not MD5s, such as SSE-KMS, large objects cannot be checked "
                "this way: see the README's \"What the checks trust\")")
    return None


def confirmed(found: RemoteObject | None, entry: FileEntry) -> bool:
    """Whether a digest of the bytes the store holds (not one recorded at upload) says they are `entry`'s."""
    if object_problem(found, entry) is not None:
        return False
    if found.hashed or found.server_sha256 is not None:
        return True
    return found.sha256 == entry.sha256 and found.recorded_etag is not None and found.etag == found.recorded_etag


def matches(found: RemoteObject | None, entry: FileEntry) -> bool:
    """Whether an upload may skip `entry`: the object there is confirmed to hold its bytes."""
    return confirmed(found, entry)


# -- uploads -----------------------------------------------------------------

def _read_verified(local: Path, entry: FileEntry, hash_locally: bool) -> tuple[bytes, str | None]:
    """The file's bytes, and, when the server does not verify (and keep) their sha256, their checked MD5.

    A server that verifies `x-amz-checksum-sha256` keeps that checksum and
    returns it on HEAD: it confirms the object by itself, so neither hash is
    computed here (this is the commit's hot path). Otherwise the bytes are
    checked against the manifest here and their MD5, the ETag S3 will give
    them, is recorded so that a later rewrite shows.
    """
    data = local.read_bytes()
    if len(data) != entry.size:
        raise _changed(local, entry, "(not hashed)", len(data))
    if not hash_locally:
        return data, None
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.sha256:
        raise _changed(local, entry, digest, len(data))
    return data, hashlib.md5(data, usedforsecurity=False).hexdigest()


def _part_digests(local: Path, entry: FileEntry) -> list[bytes]:
    """The MD5 of each part of a multipart upload, after checking the whole file's sha256 against the manifest."""
    digest, size, part_md5s = hashlib.sha256(), 0, []
    with local.open("rb") as handle:
        while chunk := handle.read(PART_SIZE_BYTES):
            digest.update(chunk)
            size += len(chunk)
            part_md5s.append(hashlib.md5(chunk, usedforsecurity=False).digest())
    if size != entry.size or digest.hexdigest() != entry.sha256:
        raise _changed(local, entry, digest.hexdigest(), size)
    return part_md5s


def multipart_etag(part_md5s: list[bytes]) -> str:
    """The ETag S3 gives a multipart object: the MD5 of its parts' MD5s, a dash, the number of parts."""
    return f"{hashlib.md5(b''.join(part_md5s), usedforsecurity=False).hexdigest()}-{len(part_md5s)}"


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
        store.request("put_object", Bucket=bucket, Key=key, Body=b"received", ChecksumSHA256=wrong)
    except OSError as error:
        if not _checksum_mismatch(error):
            raise
        verifies = True
    else:
        store.request("delete_object", Bucket=bucket, Key=key)
        verifies = False
    with _PROBE_LOCK:
        _VERIFYING_ENDPOINTS[endpoint] = verifies
    return verifies


def upload_files(store: StoreLocation, staged_dir: Path, base: str, entries: list[FileEntry],
                 deadline: Deadline | None, on_uploaded: Callable[[FileEntry], None], concurrency: int = 8) -> None:
    """Upload `entries` from `staged_dir` to `base`, concurrently; `on_uploaded` runs as each one lands."""
    jobs = [UploadJob(entry, staged_dir / entry.path, f"{base.rstrip('/')}/{entry.path}") for entry in entries]
    upload_jobs(store, jobs, deadline, on_uploaded, concurrency, probe_prefix=base)


@dataclass(frozen=True)
class UploadJob:
    """One file to upload: `item` (whose `size` and `sha256` the bytes must have, handed to `on_uploaded`),
    the staged file, and the full store path it goes to."""

    item: "FileEntry | object"
    local: Path
    target: str


def upload_jobs(store: StoreLocation, jobs: list[UploadJob], deadline: Deadline | None,
                on_uploaded: Callable, concurrency: int, probe_prefix: str) -> None:
    """Upload every job concurrently (a thread pool locally, one asyncio batch on S3), largest first."""
    if not jobs:
        return
    if store.is_local:
        _upload_local(jobs, deadline, on_uploaded, concurrency)
    elif _is_s3(store):
        hash_locally = not server_verifies_checksums(store, probe_prefix)
        run_async(store, deadline, _upload_s3, store, jobs, on_uploaded, concurrency, hash_locally)
    else:  # any other backend uploads through its own protocol method
        from .base import Upload

        items = {Upload(job.local, store.key_of(job.target), job.item.size, job.item.sha256): job.item for job in jobs}
        store.upload(list(items), on_uploaded=lambda upload: on_uploaded(items[upload]), concurrency=concurrency,
                     deadline=deadline)


def _upload_local(jobs: list[UploadJob], deadline: Deadline | None, on_uploaded: Callable, concurrency: int) -> None:
    def copy(job: UploadJob):
        if deadline is not None:
            deadline.remaining()
        entry, local, target = job.item, job.local, Path(job.target)
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
    futures = [pool.submit(copy, job) for job in sorted(jobs, key=lambda j: -j.item.size)]
    try:
        for future in as_completed(futures):
            on_uploaded(future.result())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # a failure stops the files not yet started


async def _upload_s3(store: StoreLocation, jobs: list[UploadJob], on_uploaded: Callable, concurrency: int,
                     hash_locally: bool) -> None:
    limit = asyncio.Semaphore(concurrency)
    record_lock = asyncio.Lock()

    async def upload(job: UploadJob) -> None:
        entry, local = job.item, job.local
        bucket, key = store.bucket_and_key(job.target)
        async with limit:
            if entry.size < MULTIPART_THRESHOLD_BYTES:
                data, md5 = await asyncio.to_thread(_read_verified, local, entry, hash_locally)
                checksum = base64.b64encode(bytes.fromhex(entry.sha256)).decode()
                metadata = {SHA256_METADATA_KEY: entry.sha256} | (
                    {ETAG_METADATA_KEY: md5} if md5 else {CHECKSUM_METADATA_KEY: "sha256"})
                try:
                    await store._request("put_object", Bucket=bucket, Key=key, Body=data, Metadata=metadata,
                                      ChecksumSHA256=checksum)
                except OSError as error:
                    if _checksum_mismatch(error):  # the server hashed the bytes: not the manifest's
                        raise _changed(local, entry, "(refused by the server's sha256 check)", len(data)) from error
                    raise
            else:
                await _multipart(store, bucket, key, local, entry)
        async with record_lock:  # the journal is written by one upload at a time
            await asyncio.to_thread(on_uploaded, entry)

    await asyncio.gather(*(upload(job) for job in sorted(jobs, key=lambda j: -j.item.size)))


async def _multipart(store, bucket: str, key: str, local: Path, entry: FileEntry) -> None:
    """Upload a large file in parts: hashed first, each part sent with its Content-MD5; aborted on any failure.

    Hashing before the upload lets the object carry the ETag its verified
    bytes give (metadata is fixed when the upload starts), and the server
    checks each part's MD5, so bytes that changed between the hash and the
    send are refused rather than published.
    """
    part_md5s = await asyncio.to_thread(_part_digests, local, entry)
    metadata = {SHA256_METADATA_KEY: entry.sha256, ETAG_METADATA_KEY: multipart_etag(part_md5s)}
    started = await store._request("create_multipart_upload", Bucket=bucket, Key=key, Metadata=metadata)
    upload_id = started["UploadId"]
    parts, pending = [], []
    try:
        with local.open("rb") as handle:
            for part_number, part_md5 in enumerate(part_md5s, 1):
                chunk = await asyncio.to_thread(handle.read, PART_SIZE_BYTES)
                pending.append(asyncio.ensure_future(store._request(
                    "upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=part_number, Body=chunk,
                    ContentMD5=base64.b64encode(part_md5).decode())))
                if len(pending) >= 4:  # at most four parts of one file in flight
                    await asyncio.gather(*pending)
                    parts.extend(pending)
                    pending = []
            await asyncio.gather(*pending)
            parts.extend(pending)
            if handle.read(1):
                raise _changed(local, entry, "(grew while it was uploaded)", entry.size + 1)
        await store._request("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={
            "Parts": [{"PartNumber": i, "ETag": part.result()["ETag"]} for i, part in enumerate(parts, 1)]})
    except OSError as error:
        await _abort(store, bucket, key, upload_id, pending)
        if _checksum_mismatch(error):  # a part's bytes are not the ones hashed: the file changed meanwhile
            raise _changed(local, entry, "(a part refused by the server's MD5 check)", entry.size) from error
        raise
    except BaseException:
        await _abort(store, bucket, key, upload_id, pending)
        raise


async def _abort(store, bucket: str, key: str, upload_id: str, pending: list) -> None:
    for part in pending:
        part.cancel()
    try:
        await store._request("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
    except Exception:  # noqa: BLE001 - the store may be gone; cleanup aborts it later
        pass


# -- small objects, removal, dangling uploads ---------------------------------------

def put_small(store: StoreLocation, path: str, data: bytes, deadline: Deadline | None = None) -> None:
    """Write a small object whole (atomically), with its digest recorded like any uploaded file."""
    store.put(store.key_of(path), data, deadline=deadline)


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
    if not _is_s3(store):
        store.remove([store.key_of(path) for path in paths])
        return
    store.fs.rm(paths)


def remove_left_temporaries(store: StoreLocation, prefix: str, *, skip: tuple[str, ...] = ()) -> list[str]:
    """Remove the temporary files interrupted local writes left under `prefix/`; the paths removed.

    Local stores only (an S3 PUT leaves nothing partial; its unfinished
    multipart uploads are aborted by `abort_dangling_uploads`). The caller
    holds the lease that serialises the writers of `prefix`, so a temporary
    there is a dead (or fenced-off) writer's — except this process's own and
    those under the folders in `skip` (written by processes that hold no such
    lease, such as lease records).
    """
    if not store.is_local:
        return []
    own = f"{TEMP_MARKER}{os.getpid()}-"
    root = Path(store.root).resolve()
    removed = []
    for path in sorted(list_files(store, prefix)):
        name = path.rsplit("/", 1)[-1]
        if TEMP_MARKER not in name or own in name or path.startswith(tuple(f"{folder}/" for folder in skip)):
            continue
        target = Path(prefix, path)
        # Never through a link: a linked folder inside the store could point anywhere.
        if target.parent.resolve() != root / target.parent.relative_to(store.root):
            continue
        target.unlink(missing_ok=True)
        removed.append(f"{prefix.rstrip('/')}/{path}")
    return removed


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
    if not _is_s3(store):
        return  # no other backend keeps an empty folder
    if list_files(store, base):
        return  # something landed there since: a directory with objects is never removed
    for directory in deepest_first:
        bucket, key = store.bucket_and_key(directory + "/")
        store.request("delete_object", Bucket=bucket, Key=key)
    store.fs.invalidate_cache(base)


def abort_dangling_uploads(store: StoreLocation, prefix: str) -> int:
    """Abort unfinished multipart uploads whose key lies under `prefix/` (S3 only); how many."""
    if not _is_s3(store):
        return 0
    bucket, key_prefix = store.bucket_and_key(prefix.rstrip("/") + "/")
    aborted = 0
    # A paginated listing narrowed to the prefix: uploads of other runs, or of
    # other checkpoints of this run, are never even looked at.
    token: dict = {}
    while True:
        page = store.request("list_multipart_uploads", Bucket=bucket, Prefix=key_prefix, **token)
        for upload in page.get("Uploads", []):
            if upload["Key"].startswith(key_prefix):
                store.request("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                aborted += 1
        if not page.get("IsTruncated"):
            return aborted
        token = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}
