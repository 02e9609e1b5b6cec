"""S3Store: an S3 bucket (and key prefix) as an object store, through a bounded s3fs client.

Every request S3Store makes itself goes through one async method,
`_request(method, **kwargs)`, so a test can wrap it to count requests or to
drop their preconditions. `create` and `if_match` are conditional PutObjects
(`If-None-Match: *`, `If-Match: ETAG`); a tag is the object's ETag. Request
limits, the overall `Deadline` and the translation of client failures into
OSErrors are the client's (infra/store/s3_client.py) and its error mapping's
(infra/store/s3_errors.py).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, cast

from trainer_core.run.manifest import FileEntry

from .base import (
    Deadline,
    ObjectInfo,
    PutMode,
    StoreLocation,
    StoreTimeouts,
    Upload,
    Versioned,
    find_files,
)
from .conditional import is_precondition_failure, put_conditional
from .preflight import check_credentials_setting, probe_round_trip
from .s3_client import bounded_s3_filesystem, read_body, run_async
from .s3_errors import s3_errors
from .s3_uploads import server_verifies_checksums, upload_s3
from .uploads import CHECKSUM_METADATA_KEY, ETAG_METADATA_KEY, SHA256_METADATA_KEY, RemoteObject, UploadJob

_BLOCK_BYTES = 4 * 2**20


def _remote_object(response: dict) -> RemoteObject:
    """What a HEAD in checksum mode says of an object: recorded metadata and the store's own digests."""
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
    return RemoteObject(
        int(response["ContentLength"]),
        metadata.get(SHA256_METADATA_KEY),
        server_sha256=server_sha256,
        etag=etag,
        recorded_etag=metadata.get(ETAG_METADATA_KEY),
        checksum_kept=metadata.get(CHECKSUM_METADATA_KEY) == "sha256",
    )


class S3Store(StoreLocation):
    """The store at `s3://BUCKET/PREFIX`; credentials and the endpoint come from the AWS_* variables."""

    @classmethod
    def open(cls, url: str, timeouts: StoreTimeouts) -> "S3Store":
        check_credentials_setting(url)  # half a key pair is refused by name before any request is signed
        return cls(
            fs=bounded_s3_filesystem(timeouts), root=url.removeprefix("s3://").rstrip("/"), url=url, timeouts=timeouts
        )

    @property
    def identity(self) -> str:
        return f"s3:{getattr(self.fs, 'endpoint_url', None)}:{self.bucket_and_key(self.root)[0]}"

    def describe(self) -> dict:
        return {"url": self.url, "endpoint": getattr(self.fs, "endpoint_url", None) or "aws", "root": self.root}

    def url_of(self, *parts: str) -> str:
        return "s3://" + self.path(*parts)

    def errors(self, what: str):
        return s3_errors(self, what)

    async def _request(self, method: str, **kwargs) -> dict:
        """One S3 request (the bounded client's `_call_s3`): the single seam of S3Store's own requests."""
        # `fs` is typed as fsspec's base class; here it is the bounded s3fs client, which has `_call_s3`.
        return await self.fs._call_s3(method, **kwargs)  # pyright: ignore[reportAttributeAccessIssue]

    def request(self, method: str, **kwargs) -> dict:
        """`_request`, waited for on the client's event loop (no deadline but the request's own limit)."""
        return run_async(self, None, self._request, method, **kwargs)

    def _location(self, key: str) -> dict:
        bucket, object_key = self.bucket_and_key(self.path(key))
        return {"Bucket": bucket, "Key": object_key}

    def get(self, key: str) -> Versioned | None:
        async def get() -> Versioned:
            response = await self._request("get_object", **self._location(key))
            async with response["Body"] as stream:
                return Versioned(await stream.read(), response["ETag"])

        try:
            # A body cut short after its headers is read again (botocore cannot retry it).
            return run_async(self, None, read_body, self.timeouts, get)
        except FileNotFoundError:
            return None

    def put(
        self,
        key: str,
        data: bytes,
        *,
        mode: PutMode = "overwrite",
        tag: str | None = None,
        deadline: Deadline | None = None,
    ) -> str | None:
        if mode != "overwrite":
            return put_conditional(self, key, data, mode, tag)
        digest = hashlib.sha256(data).hexdigest()
        metadata = {
            SHA256_METADATA_KEY: digest,
            ETAG_METADATA_KEY: hashlib.md5(data, usedforsecurity=False).hexdigest(),
        }
        response = run_async(
            self,
            deadline,
            self._request,
            "put_object",
            **self._location(key),
            Body=data,
            Metadata=metadata,
            ChecksumSHA256=base64.b64encode(bytes.fromhex(digest)).decode(),
        )
        return response["ETag"]

    def conditional_write(self, key: str, data: bytes, tag: str | None) -> str | None:
        """One conditional PutObject, unconfirmed: `If-None-Match: *` when `tag` is None, else `If-Match: tag`."""
        condition = {"IfNoneMatch": "*"} if tag is None else {"IfMatch": tag}
        try:
            response = run_async(self, None, self._request, "put_object", **self._location(key), Body=data, **condition)
        except OSError as error:
            if is_precondition_failure(error):
                return None
            raise
        return response["ETag"]

    def head(self, keys: Sequence[str], *, deadline: Deadline | None = None) -> dict[str, ObjectInfo]:
        async def head_all() -> dict[str, ObjectInfo]:
            limit = asyncio.Semaphore(16)

            async def head(key: str) -> tuple[str, ObjectInfo | None]:
                async with limit:
                    try:
                        response = await self._request("head_object", **self._location(key))
                    except FileNotFoundError:
                        return key, None
                metadata = {k.lower(): v for k, v in (response.get("Metadata") or {}).items()}
                return key, ObjectInfo(int(response["ContentLength"]), metadata.get("sha256"))

            pairs = await asyncio.gather(*(head(key) for key in keys))
            return {key: info for key, info in pairs if info is not None}

        return run_async(self, deadline, head_all)

    def remote_objects(
        self, base: str, entries: list[FileEntry], deadline: Deadline | None, concurrency: int = 16
    ) -> dict[str, RemoteObject]:
        """What the store says of each entry present under the full path `base`: one HEAD each, in checksum mode."""

        async def head_all() -> dict[str, RemoteObject]:
            limit = asyncio.Semaphore(concurrency)

            async def head(entry: FileEntry) -> tuple[str, RemoteObject | None]:
                bucket, key = self.bucket_and_key(f"{base}/{entry.path}")
                async with limit:
                    try:
                        # Checksum mode: S3 returns the checksum it stored for the object's bytes.
                        response = await self._request("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED")
                    except FileNotFoundError:
                        return entry.path, None
                return entry.path, _remote_object(response)

            pairs = await asyncio.gather(*(head(entry) for entry in entries))
            return {path: found for path, found in pairs if found is not None}

        return run_async(self, deadline, head_all)

    def list(self, prefix: str) -> dict[str, int]:
        return find_files(self.fs, self.path(prefix))

    def remove(self, keys: Sequence[str]) -> None:
        if keys:
            self.fs.rm([self.path(key) for key in keys])

    def remove_empty_directories(self, base: str, deepest_first: list[str]) -> None:
        """Delete the directory entries (keys ending in '/') of `deepest_first`, once nothing is left under `base/`.

        SeaweedFS keeps a directory after its last object is removed, and a
        reader would list it as a checkpoint; deleting one is a no-op where
        the store has no such entry (as on AWS).
        """
        if find_files(self.fs, base):
            return  # something landed there since: a directory with objects is never removed
        for directory in deepest_first:
            bucket, key = self.bucket_and_key(directory + "/")
            self.request("delete_object", Bucket=bucket, Key=key)
        self.fs.invalidate_cache(base)

    @contextlib.contextmanager
    def open_read(self, key: str) -> Iterator[BinaryIO]:
        with self.fs.open(self.path(key), "rb", block_size=_BLOCK_BYTES, cache_type="none") as handle:
            yield cast("BinaryIO", handle)  # mode "rb": a binary file (fsspec's inferred type also names a text one)

    def upload(
        self,
        uploads: Sequence[Upload],
        *,
        on_uploaded: Callable[[Upload], None],
        concurrency: int = 8,
        deadline: Deadline | None = None,
    ) -> None:
        jobs = [UploadJob(upload, upload.local, self.path(upload.key)) for upload in uploads]
        probe_prefix = self.path(uploads[0].key).rsplit("/", 1)[0] if uploads else self.root
        self.upload_jobs(jobs, deadline, on_uploaded, concurrency, probe_prefix=probe_prefix)

    def upload_jobs(
        self,
        jobs: list[UploadJob],
        deadline: Deadline | None,
        on_uploaded: Callable,
        concurrency: int,
        probe_prefix: str,
    ) -> None:
        """Upload every job in one asyncio batch on the client's loop, largest first (infra/store/s3_uploads.py)."""
        if not jobs:
            return
        hash_locally = not server_verifies_checksums(self, probe_prefix)
        run_async(self, deadline, upload_s3, self, jobs, on_uploaded, concurrency, hash_locally)

    def abort_uploads(self, prefix: str) -> int:
        bucket, key_prefix = self.bucket_and_key(self.path(prefix).rstrip("/") + "/")
        aborted = 0
        # A paginated listing narrowed to the prefix: uploads of other runs, or of
        # other checkpoints of this run, are never even looked at.
        token: dict = {}
        while True:
            page = self.request("list_multipart_uploads", Bucket=bucket, Prefix=key_prefix, **token)
            for upload in page.get("Uploads", []):
                if upload["Key"].startswith(key_prefix):
                    self.request(
                        "abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
                    aborted += 1
            if not page.get("IsTruncated"):
                return aborted
            token = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def check_writable(self) -> None:
        probe_round_trip(self)

    def overlaps(self, path: Path) -> bool:
        return False  # a bucket is never a local directory
