"""What every backend shares about a stored file: the metadata it carries, and what that evidence proves.

A leaf module (it imports no backend), so that the backends and the
operations built on them (objects.py) all import it and never each other.

- Metadata rankflow records with an uploaded object: its sha256
  (`SHA256_METADATA_KEY`), the ETag the verified bytes give
  (`ETAG_METADATA_KEY`), or that the server verified and keeps its sha256
  checksum (`CHECKSUM_METADATA_KEY`).
- `RemoteObject`: what the store says of one object (each backend's
  `remote_objects`; `local_digests.py` for a store that hashes its own
  bytes), and `object_problem` / `confirmed` / `matches`: what that evidence
  proves. A recorded digest is only what was true at upload; bytes
  rewritten later keep their metadata. Only a digest the store computed from
  the bytes it holds (or a local hash) *confirms* an object; a recorded digest
  that disagrees, or an ETag other than the one recorded, *refutes* it.
- `Upload`, one file to send, `UploadJob`, one planned upload, and
  `StagedFileChanged`, what an upload of bytes that no longer match their
  manifest raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainer_core.run.manifest import FileEntry

SHA256_METADATA_KEY = "sha256"
ETAG_METADATA_KEY = "etag"
"""Metadata: the ETag the store computes from the bytes rankflow verified and sent (a rewrite changes the real one)."""
CHECKSUM_METADATA_KEY = "checksum"
"""Metadata: "sha256" when the object was sent with an x-amz-checksum-sha256 that the server verified and keeps
(a rewrite without it leaves the object with no checksum: refuted at no hashing cost)."""


@dataclass(frozen=True)
class Upload:
    """One local file to upload to `key`, with the size and sha256 its bytes must have."""

    local: Path
    key: str
    size: int
    sha256: str


class StagedFileChanged(ValueError):
    """A staged file's bytes no longer match its manifest: the export must be redone, not uploaded."""


def changed(local: Path, entry: "FileEntry | Upload", digest: str, size: int) -> StagedFileChanged:
    """The error for staged `local` whose bytes (`size`, `digest`) are not `entry`'s (a FileEntry or an Upload)."""
    return StagedFileChanged(
        f"staged file {local} no longer matches its manifest (size {size} vs {entry.size}, sha256 {digest[:12]}… vs "
        f"{entry.sha256[:12]}…); the export is re-done, not uploaded"
    )


@dataclass(frozen=True)
class SavedFile:
    """A local file whose sha256 is known without reading it: a saved state's file, untouched since its save
    (trainer_core/run/state_record.py), and what identifies those bytes on disk (checked again after a hard link)."""

    size: int
    sha256: str
    mtime_ns: int
    inode: int


@dataclass(frozen=True)
class UploadJob:
    """One file to upload: `item` (whose `size` and `sha256` the bytes must have, handed to `on_uploaded`),
    the staged file, and the full store path it goes to."""

    item: "FileEntry | Upload"
    local: Path
    target: str
    saved: SavedFile | None = None
    """Set for a saved state's file: a local store on the same filesystem takes it by hard link, not a copy."""


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


def object_problem(found: RemoteObject | None, entry: FileEntry) -> str | None:
    """Why the stored object is not `entry`'s bytes, by what the store says of it; None when nothing refutes it."""
    if found is None:
        return "missing"
    if found.size != entry.size:
        return f"size {found.size}, manifest says {entry.size}"
    if found.hashed:
        return (
            None
            if found.sha256 == entry.sha256
            else f"sha256 {found.sha256} does not match the manifest's {entry.sha256}"
        )
    if found.server_sha256 is not None and found.server_sha256 != entry.sha256:
        return (
            f"the store's own sha256 of its bytes, {found.server_sha256}, does not match the manifest's {entry.sha256}"
        )
    if found.sha256 is not None and found.sha256 != entry.sha256:
        return f"recorded sha256 {found.sha256} does not match the manifest's"
    if found.server_sha256 is None and found.checksum_kept:
        return (
            "it was uploaded with its sha256 checksum, which the store no longer holds: the object was rewritten since"
        )
    if found.server_sha256 is None and found.recorded_etag is not None and found.etag != found.recorded_etag:
        return (
            f"its ETag {found.etag} is not {found.recorded_etag}, the ETag of the bytes uploaded: the object was "
            "rewritten since (on a store whose ETags are not MD5s, such as SSE-KMS, large objects cannot be checked "
            'this way: see the README\'s "What the checks trust")'
        )
    return None


def confirmed(found: RemoteObject | None, entry: FileEntry) -> bool:
    """Whether a digest of the bytes the store holds (not one recorded at upload) says they are `entry`'s."""
    if found is None or object_problem(found, entry) is not None:
        return False
    if found.hashed or found.server_sha256 is not None:
        return True
    return found.sha256 == entry.sha256 and found.recorded_etag is not None and found.etag == found.recorded_etag


def matches(found: RemoteObject | None, entry: FileEntry) -> bool:
    """Whether an upload may skip `entry`: the object there is confirmed to hold its bytes."""
    return confirmed(found, entry)
