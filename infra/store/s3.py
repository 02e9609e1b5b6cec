"""S3Store: an S3 bucket (and key prefix) as an object store, through a bounded s3fs client.

Every request S3Store makes itself goes through one async method,
`_request(method, **kwargs)`, so a test can wrap it to count requests or to
drop their preconditions. `create` and `if_match` are conditional PutObjects
(`If-None-Match: *`, `If-Match: ETAG`); a tag is the object's ETag. Request
limits, the overall `Deadline` and the translation of client failures into
OSErrors are those of infra/store/base.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from .base import (Deadline, ObjectInfo, PutMode, StorageTimeoutError, StoreLocation, StoreTimeouts, Upload, Versioned,
                   read_body, run_async, s3_options_from_env, storage_errors)

_BLOCK_BYTES = 4 * 2**20


def _bounded_s3_filesystem(timeouts: StoreTimeouts):
    """s3fs whose every request has a wall-clock limit.

    botocore's read timeout does not cover every wait: a PutObject to a
    stopped (SIGSTOP) server blocks forever in aiohttp, however small its
    body. Each request therefore gets at most max_attempts × (connect_s +
    read_s), after which it fails with a StorageTimeoutError.
    """
    import asyncio

    import s3fs  # imported here: local runs need no S3 client
    from fsspec.asyn import sync_wrapper

    limit_s = timeouts.max_attempts * (timeouts.connect_s + timeouts.read_s)

    class BoundedS3FileSystem(s3fs.S3FileSystem):
        async def _cat_file(self, path, *args, **kwargs):
            # A body cut short is no request error botocore could retry (its headers had come).
            return await read_body(timeouts, lambda: super(BoundedS3FileSystem, self)._cat_file(path, *args, **kwargs))

        async def _call_s3(self, method, *args, **kwargs):
            try:
                return await asyncio.wait_for(super()._call_s3(method, *args, **kwargs), limit_s)
            except asyncio.TimeoutError as error:
                raise StorageTimeoutError(
                    f"S3 {method} at {self.endpoint_url} got no answer within {limit_s:g} s (storage.request_timeout_s "
                    "per attempt); the server is stopped or overloaded — retry when it answers, finished uploads "
                    "are kept") from error

        # s3fs binds its public call_s3 to the base class's _call_s3: bind it to this one.
        call_s3 = sync_wrapper(_call_s3)

    return BoundedS3FileSystem


def bounded_s3_filesystem(timeouts: StoreTimeouts):
    """An s3fs client whose requests are bounded by `timeouts`, with s3fs's own retry rounds off."""
    fs = _bounded_s3_filesystem(timeouts)(**s3_options_from_env(timeouts))
    # s3fs retries connection errors on its own (5 rounds, a class
    # attribute) on top of botocore's attempts: one round leaves the
    # count to StoreTimeouts.max_attempts, so a dead endpoint fails in
    # about max_attempts × read_s. The one thing only s3fs's rounds
    # retried, a streamed body cut short, `read_body` retries instead.
    fs.retries = 1
    return fs



class S3Store(StoreLocation):
    """The store at `s3://BUCKET/PREFIX`; credentials and the endpoint come from the AWS_* variables."""

    @classmethod
    def open(cls, url: str, timeouts: StoreTimeouts) -> "S3Store":
        return cls(fs=bounded_s3_filesystem(timeouts), root=url.removeprefix("s3://").rstrip("/"), url=url,
                   timeouts=timeouts)

    @property
    def identity(self) -> str:
        return f"s3:{getattr(self.fs, 'endpoint_url', None)}:{self.bucket_and_key(self.root)[0]}"

    def describe(self) -> dict:
        return {"url": self.url, "endpoint": getattr(self.fs, "endpoint_url", None) or "aws", "root": self.root}

    def url_of(self, *parts: str) -> str:
        return "s3://" + self.path(*parts)

    def errors(self, what: str):
        return storage_errors(self, what)

    async def _request(self, method: str, **kwargs) -> dict:
        """One S3 request (the bounded client's `_call_s3`): the single seam of S3Store's own requests."""
        return await self.fs._call_s3(method, **kwargs)

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

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite", tag: str | None = None,
            deadline: Deadline | None = None) -> str | None:
        from .conditional import create_if_absent, replace_if_unchanged
        from .objects import ETAG_METADATA_KEY, SHA256_METADATA_KEY

        path = self.path(key)
        if mode == "create":
            return create_if_absent(self, path, data)
        if mode == "if_match":
            if tag is None:
                raise ValueError(f"put(mode='if_match') of {key} names no tag")
            return replace_if_unchanged(self, path, data, tag)
        digest = hashlib.sha256(data).hexdigest()
        metadata = {SHA256_METADATA_KEY: digest, ETAG_METADATA_KEY: hashlib.md5(data, usedforsecurity=False).hexdigest()}
        response = run_async(self, deadline, self._request, "put_object", **self._location(key), Body=data,
                             Metadata=metadata, ChecksumSHA256=base64.b64encode(bytes.fromhex(digest)).decode())
        return response["ETag"]

    def conditional_write(self, key: str, data: bytes, tag: str | None) -> str | None:
        """One conditional PutObject, unconfirmed: `If-None-Match: *` when `tag` is None, else `If-Match: tag`."""
        from .conditional import is_precondition_failure

        condition = {"IfNoneMatch": "*"} if tag is None else {"IfMatch": tag}
        try:
            response = run_async(self, None, self._request, "put_object", **self._location(key), Body=data,
                                 **condition)
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

    def list(self, prefix: str) -> dict[str, int]:
        from .objects import list_files

        return list_files(self, self.path(prefix))

    def children(self, prefix: str) -> list[str]:
        base = self.path(prefix).rstrip("/")
        try:
            found = self.fs.ls(base, detail=False)
        except FileNotFoundError:
            return []
        return sorted({path.rstrip("/").rsplit("/", 1)[-1] for path in found if path.rstrip("/") != base})

    def remove(self, keys: Sequence[str]) -> None:
        from .objects import remove_files

        remove_files(self, self.root, list(keys))

    @contextlib.contextmanager
    def open_read(self, key: str) -> Iterator[BinaryIO]:
        with self.fs.open(self.path(key), "rb", block_size=_BLOCK_BYTES, cache_type="none") as handle:
            yield handle

    def upload(self, uploads: Sequence[Upload], *, on_uploaded: Callable[[Upload], None], concurrency: int = 8,
               deadline: Deadline | None = None) -> None:
        from .objects import UploadJob, upload_jobs

        jobs = [UploadJob(upload, upload.local, self.path(upload.key)) for upload in uploads]
        probe_prefix = self.path(uploads[0].key).rsplit("/", 1)[0] if uploads else self.root
        upload_jobs(self, jobs, deadline, on_uploaded, concurrency, probe_prefix=probe_prefix)

    def abort_uploads(self, prefix: str) -> int:
        from .objects import abort_dangling_uploads

        return abort_dangling_uploads(self, self.path(prefix))

    def check_writable(self) -> None:
        from .preflight import check_store_writable

        check_store_writable(self.url)

    def overlaps(self, path: Path) -> bool:
        return False  # a bucket is never a local directory
