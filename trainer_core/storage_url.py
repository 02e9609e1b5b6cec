"""Check the shape of a `storage.url` before anything touches the store.

A local path, `file://PATH` or `s3://BUCKET/PREFIX`. Only the URL is checked
here (no network): a missing bucket, a bucket name no S3 server accepts, an
empty or `..` path segment, or an unknown scheme. Whether the store is
reachable and writable is checked by the storage pre-flight before training.

The overlap rule of a local store and a local directory (`local_path`,
`overlap`) is here too, the one copy the config's location check and
`LocalStore.overlaps` share.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from .input_files import resolved_path
from .registry_names import STORE_SCHEMES

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# S3's rules (3-63 characters of lowercase letters, digits, '.' and '-', starting and
# ending with a letter or digit), widened to the legacy upper case and '_' some servers keep.
_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,253}[A-Za-z0-9]$")
_FORMS = "a local path, file://PATH or s3://BUCKET/PREFIX"


def check_storage_url(url: str) -> str:
    """Return `url` unchanged, or raise ValueError saying what is wrong and what to write."""
    if not url.strip():
        raise ValueError(f"storage.url is empty; set {_FORMS}")
    if url != url.strip():
        raise ValueError(f"storage.url={url!r} starts or ends with whitespace; remove it")
    scheme = _SCHEME.match(url)
    if scheme is None:
        return url  # a local path
    if scheme[1] not in STORE_SCHEMES:
        raise ValueError(f"storage.url={url!r}: unsupported scheme {scheme[1]!r}; use {_FORMS}")
    if scheme[1] == "file":
        if not url.removeprefix("file://"):
            raise ValueError(f"storage.url={url!r} has no path; write file:///absolute/path or a plain path")
        return url
    assert scheme[1] == "s3", f"storage.url scheme {scheme[1]!r} is registered but its URL is not checked here"
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    if not bucket:
        raise ValueError(f"storage.url={url!r} names no bucket; write s3://BUCKET/PREFIX, e.g. s3://rankflow/runs")
    if not _BUCKET.match(bucket):
        raise ValueError(
            f"storage.url={url!r}: {bucket!r} is not a valid S3 bucket name; bucket names are 3-63 "
            "lowercase letters, digits, '.' and '-', starting and ending with a letter or digit"
        )
    segments = prefix.rstrip("/").split("/") if prefix.rstrip("/") else []
    if "" in segments or ".." in segments or "." in segments:
        raise ValueError(
            f"storage.url={url!r} has an empty, '.' or '..' path segment; write the prefix as "
            "plain names joined by single '/', e.g. s3://rankflow/runs/team-a"
        )
    return url


Overlap = Literal["same", "first_inside", "second_inside"]


def local_path(url: str) -> Path | None:
    """The resolved directory of a local store (`file://PATH` or a plain path); None for an object store."""
    if "://" in url and not url.startswith("file://"):
        return None  # an object store cannot overlap a local directory
    return Path(url.removeprefix("file://")).expanduser().resolve()


def check_local_store(url: str, key: str) -> None:
    """A local store (`file://PATH` or a plain path) reached through a symbolic link loop is bad input naming `key`:
    reading through it fails with ELOOP, an OSError the readers would take for an outage. An object store passes."""
    if "://" not in url or url.startswith("file://"):
        resolved_path(url.removeprefix("file://"), key, fix="give the store's real directory")


def overlap(first: str | Path, second: str | Path) -> Overlap | None:
    """How two local directories overlap, once both are resolved: the same, one inside the other, or None."""
    first, second = Path(first).resolve(), Path(second).resolve()
    if first == second:
        return "same"
    if first.is_relative_to(second):
        return "first_inside"
    if second.is_relative_to(first):
        return "second_inside"
    return None
