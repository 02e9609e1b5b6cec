"""S3Store's verified uploads: one asyncio batch per commit, single PUTs with their sha256, multipart for large files.

Each single-request upload carries the manifest's sha256 as
`x-amz-checksum-sha256`: a server that verifies it (probed once per endpoint,
`server_verifies_checksums`; SeaweedFS and AWS do) refuses other bytes and
keeps the checksum, so the client need not hash them again; otherwise the
client hashes them (sha256 against the manifest, MD5 recorded as the ETag). A
multipart upload hashes the file first (sha256 against the manifest, MD5 per
part) and sends each part with its `Content-MD5`, so the server refuses a part
whose bytes changed since. A staged file whose bytes no longer match its
manifest raises StagedFileChanged instead of being published.

Every request goes through the store's `_request` (infra/store/s3.py); this
module imports no backend.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import secrets
import threading
from collections.abc import Callable
from pathlib import Path

from trainer_core.run.manifest import FileEntry

from .uploads import CHECKSUM_METADATA_KEY, ETAG_METADATA_KEY, SHA256_METADATA_KEY, Upload, UploadJob, changed

MULTIPART_THRESHOLD_BYTES = 64 * 2**20
PART_SIZE_BYTES = 16 * 2**20


def _read_verified(local: Path, entry: FileEntry | Upload, hash_locally: bool) -> tuple[bytes, str | None]:
    """The file's bytes, and, when the server does not verify (and keep) their sha256, their checked MD5.

    A server that verifies `x-amz-checksum-sha256` keeps that checksum and
    returns it on HEAD: it confirms the object by itself, so neither hash is
    computed here (this is the commit's hot path). Otherwise the bytes are
    checked against the manifest here and their MD5, the ETag S3 will give
    them, is recorded so that a later rewrite shows.
    """
    data = local.read_bytes()
    if len(data) != entry.size:
        raise changed(local, entry, "(not hashed)", len(data))
    if not hash_locally:
        return data, None
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.sha256:
        raise changed(local, entry, digest, len(data))
    return data, hashlib.md5(data, usedforsecurity=False).hexdigest()


def _part_digests(local: Path, entry: FileEntry | Upload) -> list[bytes]:
    """The MD5 of each part of a multipart upload, after checking the whole file's sha256 against the manifest."""
    digest, size, part_md5s = hashlib.sha256(), 0, []
    with local.open("rb") as handle:
        while chunk := handle.read(PART_SIZE_BYTES):
            digest.update(chunk)
            size += len(chunk)
            part_md5s.append(hashlib.md5(chunk, usedforsecurity=False).digest())
    if size != entry.size or digest.hexdigest() != entry.sha256:
        raise changed(local, entry, digest.hexdigest(), size)
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


def server_verifies_checksums(store, probe_prefix: str) -> bool:
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


async def upload_s3(store, jobs: list[UploadJob], on_uploaded: Callable, concurrency: int, hash_locally: bool) -> None:
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
                    {ETAG_METADATA_KEY: md5} if md5 else {CHECKSUM_METADATA_KEY: "sha256"}
                )
                try:
                    await store._request(
                        "put_object", Bucket=bucket, Key=key, Body=data, Metadata=metadata, ChecksumSHA256=checksum
                    )
                except OSError as error:
                    if _checksum_mismatch(error):  # the server hashed the bytes: not the manifest's
                        raise changed(local, entry, "(refused by the server's sha256 check)", len(data)) from error
                    raise
            else:
                await _multipart(store, bucket, key, local, entry)
        async with record_lock:  # the journal is written by one upload at a time
            # Waited for to its end even when the batch stops meanwhile (a sibling failed, the deadline
            # passed): a cancelled await would leave the thread writing the journal after the error
            # went up. The upload landed; its record is written first.
            recording = asyncio.ensure_future(asyncio.to_thread(on_uploaded, entry))
            await settled([recording])
            recording.result()  # a record that failed (a lost lease) says so

    tasks = [asyncio.ensure_future(upload(job)) for job in sorted(jobs, key=lambda j: -j.item.size)]
    try:
        await asyncio.gather(*tasks)
    except BaseException as error:
        # gather raises at the first failure and leaves the other uploads running; the caller then
        # releases the finalizer lease, and an upload still running would write without it (as a
        # local store's pool, stop the rest and wait for them before the error goes up).
        if not isinstance(error, asyncio.CancelledError):
            for task in tasks:
                task.cancel()
        # Cancelled from outside (the deadline), gather has cancelled each task already: a second
        # cancel would cut their clean-up (a record, a multipart abort) short.
        await settled(tasks)
        raise


async def settled(tasks: list) -> None:
    """Wait until every task is done, whatever cancels the waiter meanwhile.

    The tasks' own clean-up is bounded (each request has its wall-clock limit,
    infra/store/s3.py), so this ends; a cancel that lands here is not passed on
    to them. The caller raises its own error (or cancellation) afterwards.
    """
    while not all(task.done() for task in tasks):
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(asyncio.wait(tasks))


async def _multipart(store, bucket: str, key: str, local: Path, entry: FileEntry | Upload) -> None:
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
                pending.append(
                    asyncio.ensure_future(
                        store._request(
                            "upload_part",
                            Bucket=bucket,
                            Key=key,
                            UploadId=upload_id,
                            PartNumber=part_number,
                            Body=chunk,
                            ContentMD5=base64.b64encode(part_md5).decode(),
                        )
                    )
                )
                if len(pending) >= 4:  # at most four parts of one file in flight
                    await asyncio.gather(*pending)
                    parts.extend(pending)
                    pending = []
            await asyncio.gather(*pending)
            parts.extend(pending)
            if handle.read(1):
                raise changed(local, entry, "(grew while it was uploaded)", entry.size + 1)
        await store._request(
            "complete_multipart_upload",
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={
                "Parts": [{"PartNumber": i, "ETag": part.result()["ETag"]} for i, part in enumerate(parts, 1)]
            },
        )
    except OSError as error:
        await _abort(store, bucket, key, upload_id, pending)
        if _checksum_mismatch(error):  # a part's bytes are not the ones hashed: the file changed meanwhile
            raise changed(local, entry, "(a part refused by the server's MD5 check)", entry.size) from error
        raise
    except BaseException:
        await _abort(store, bucket, key, upload_id, pending)
        raise


async def _abort(store, bucket: str, key: str, upload_id: str, pending: list) -> None:
    for part in pending:
        part.cancel()
    # A part still in flight when the abort lands could be stored after it (S3 asks to abort again then):
    # the parts stop first.
    await asyncio.gather(*pending, return_exceptions=True)
    try:
        await store._request("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
    except Exception:  # noqa: BLE001 - the store may be gone; cleanup aborts it later
        pass
