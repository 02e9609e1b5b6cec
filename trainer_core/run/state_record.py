"""A saved state's local record: each file as the save left it on this disk, and its sha256 once computed.

    RUN_DIR/state/segment-NNNN/             the state (files fsync'd, directory renamed into place)
    RUN_DIR/state/segment-NNNN.local.json   its record (`LocalStateRecord`), beside it, never in a bundle:
                                            it describes this machine's copy, not the state

The save (rank 0, once the state is in place) makes every file and directory
durable and records each file's *fingerprint*: size, mtime_ns, ctime_ns,
inode and device. Hashing is not part of the save: sha256 runs at about
0.6 s/GB here, more than half the boundary's budget, so the digest is computed
once, by the state upload off the critical path (`digests`), from the page
cache, and written into the record for every later reader (the bundle
manifest, a retried upload, an export's check).

**The trust rule** (`LocalState.untouched`, one place): a file whose
fingerprint equals its record is the file the save fsync'd, untouched since,
and is trusted without reading it; its recorded sha256 stands for its bytes.
User space can set a file's mtime (`os.utime`, `touch -r`, `cp -p`) but not its
ctime: any write, `utime`, `chmod` or link changes the ctime. So bytes
rewritten in place, with the mtime put back or not, fail the rule. A file that
fails it is hashed: if the hash equals the recorded sha256 it is still the
saved file (a `touch`, a hard link); if not, or if no sha256 was recorded yet,
the local state is not the one the save wrote (`LocalStateChanged`). A
symbolic link anywhere in the state, or a file the record does not list (or
one it lists that is gone), fails the rule too: nothing is read through a link
and nothing the save did not write is uploaded. What the rule cannot see is a
change below the filesystem (a disk that returns other bytes under the same
inode and times); the store's checks, which hash what the store holds, are
unchanged (docs/publication.md, "What the checks trust").
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from trainer_core.files import size_and_sha256
from trainer_core.thread_priority import yield_cpu

RECORD_FORMAT = "rankflow-local-state/1"
_HASH_THREADS = 4
"""Files hashed at once: hashlib releases the GIL over a block, so threads hash in parallel (as ranks would)."""


class LocalStateChanged(ValueError):
    """A local state's files are not those its save wrote (changed, gone, added, or a link): never uploaded."""


class LocalFile(BaseModel):
    """One file of a saved state, as the save left it on this disk."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    path: str
    """Relative to the state directory, '/'-separated."""
    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    device: int
    sha256: str | None = None
    """Computed once, by the state upload (None until then)."""


class LocalStateRecord(BaseModel):
    """The record of one saved state on this machine (`record_path`)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    format: Literal["rankflow-local-state/1"]
    files: list[LocalFile]


def record_path(state_dir: Path) -> Path:
    return state_dir.with_name(f"{state_dir.name}.local.json")


def _fingerprint(stat: os.stat_result) -> tuple[int, int, int, int, int]:
    return (stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev)


def _entry_fingerprint(entry: LocalFile) -> tuple[int, int, int, int, int]:
    return (entry.size, entry.mtime_ns, entry.ctime_ns, entry.inode, entry.device)


def _local_file(state_dir: Path, path: Path, sha256: str | None = None) -> LocalFile:
    size, mtime_ns, ctime_ns, inode, device = _fingerprint(path.lstat())
    relative = path.relative_to(state_dir).as_posix()
    return LocalFile(
        path=relative, size=size, mtime_ns=mtime_ns, ctime_ns=ctime_ns, inode=inode, device=device, sha256=sha256
    )


def _fsync(path: Path, *, directory: bool = False) -> None:
    descriptor = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def make_durable(directory: Path) -> None:
    """fsync every file under `directory` (in parallel), then every directory, deepest first."""
    files = [p for p in directory.rglob("*") if p.is_file() and not p.is_symlink()]
    with ThreadPoolExecutor(max_workers=_HASH_THREADS) as pool:
        list(pool.map(_fsync, files))
    directories = [p for p in directory.rglob("*") if p.is_dir() and not p.is_symlink()]
    for path in sorted(directories, key=lambda p: len(p.parts), reverse=True) + [directory]:
        _fsync(path, directory=True)


def forget_record(state_dir: Path) -> None:
    """Remove the record before its state is replaced: no record ever describes another state's files."""
    record_path(state_dir).unlink(missing_ok=True)


def write_record(state_dir: Path) -> LocalStateRecord:
    """Record every file of the state now in place (rank 0, after the rename), durably."""
    files = sorted((p for p in state_dir.rglob("*") if p.is_file() and not p.is_symlink()), key=lambda p: p.as_posix())
    record = LocalStateRecord(format=RECORD_FORMAT, files=[_local_file(state_dir, p) for p in files])
    _write(state_dir, record)
    return record


def _write(state_dir: Path, record: LocalStateRecord) -> None:
    path = record_path(state_dir)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{id(record)}")
    with open(tmp, "w") as handle:
        handle.write(record.model_dump_json(indent=1))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync(path.parent, directory=True)


class LocalState:
    """A state directory read through its record (`load`); None from `load` when there is no readable record."""

    def __init__(self, state_dir: Path, record: LocalStateRecord) -> None:
        self.state_dir = state_dir
        self.record = record
        self._by_path = {entry.path: entry for entry in record.files}

    @classmethod
    def load(cls, state_dir: Path) -> LocalState | None:
        try:
            text = record_path(state_dir).read_text()
            return cls(state_dir, LocalStateRecord.model_validate_json(text))
        except (OSError, ValueError):
            return None  # no record (a state fetched from the store, or saved before records): hash as before

    def untouched(self, relative: str) -> bool:
        """The trust rule: the file is a regular file whose fingerprint is the record's (see the module doc)."""
        entry = self._by_path.get(relative)
        if entry is None:
            return False
        try:
            stat = (self.state_dir / relative).lstat()
        except OSError:
            return False
        return not _has_link(self.state_dir, relative) and _fingerprint(stat) == _entry_fingerprint(entry)

    def unlisted(self) -> list[str]:
        """What the state holds that the record does not list, or that is a link (relative paths)."""
        if self.state_dir.is_symlink():
            return ["."]
        found = []
        for path in sorted(self.state_dir.rglob("*")):
            relative = path.relative_to(self.state_dir).as_posix()
            if path.is_symlink() or (path.is_file() and relative not in self._by_path):
                found.append(relative)
        return found

    def check(self) -> None:
        """Raise LocalStateChanged unless every file is the saved one (untouched, or hashed equal to its digest)."""
        extra = self.unlisted()
        if extra:
            raise self._changed(f"{', '.join(extra)} {'is' if len(extra) == 1 else 'are'} not a file its save wrote")
        touched = [entry for entry in self.record.files if not self.untouched(entry.path)]
        for entry in touched:
            self._rehashed(entry)

    def digests(self) -> dict[str, tuple[int, str]]:
        """Every file's (size, sha256), hashed only where not recorded yet, and recorded; checked by the rule."""
        self.check()
        missing = [entry for entry in self.record.files if entry.sha256 is None]
        with ThreadPoolExecutor(max_workers=_HASH_THREADS, initializer=yield_cpu) as pool:
            hashed = dict(zip([e.path for e in missing], pool.map(self._hash_unchanged, missing), strict=True))
        if hashed:
            files = [
                entry.model_copy(update={"sha256": hashed[entry.path]}) if entry.path in hashed else entry
                for entry in self.record.files
            ]
            self.record = LocalStateRecord(format=RECORD_FORMAT, files=files)
            self._by_path = {entry.path: entry for entry in files}
            _write(self.state_dir, self.record)
        return {entry.path: (entry.size, entry.sha256) for entry in self.record.files if entry.sha256 is not None}

    def restamp(self) -> None:
        """Take the new ctime of files hard-linked since (a local store took them): same inode, size and mtime."""
        files, changed = [], False
        for entry in self.record.files:
            try:
                stat = (self.state_dir / entry.path).lstat()
            except OSError:
                files.append(entry)
                continue
            same_bytes = (stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_dev) == (
                entry.size,
                entry.mtime_ns,
                entry.inode,
                entry.device,
            )
            if same_bytes and stat.st_nlink > 1 and stat.st_ctime_ns != entry.ctime_ns:
                entry = entry.model_copy(update={"ctime_ns": stat.st_ctime_ns})
                changed = True
            files.append(entry)
        if changed:
            self.record = LocalStateRecord(format=RECORD_FORMAT, files=files)
            self._by_path = {entry.path: entry for entry in files}
            _write(self.state_dir, self.record)

    def _hash_unchanged(self, entry: LocalFile) -> str:
        """Hash a file not hashed yet; the fingerprint before and after says the bytes hashed are the saved ones."""
        if not self.untouched(entry.path):
            raise self._changed(f"{entry.path} changed after its save, before its sha256 was recorded")
        size, sha256 = size_and_sha256(self.state_dir / entry.path)
        if size != entry.size or not self.untouched(entry.path):
            raise self._changed(f"{entry.path} changed while it was hashed")
        return sha256

    def _rehashed(self, entry: LocalFile) -> None:
        path = self.state_dir / entry.path
        if entry.sha256 is None or _has_link(self.state_dir, entry.path) or not path.is_file():
            raise self._changed(f"{entry.path} is gone or changed after its save, before its sha256 was recorded")
        if size_and_sha256(path) != (entry.size, entry.sha256):
            raise self._changed(f"{entry.path} no longer has the bytes its save wrote (sha256 differs)")

    def _changed(self, what: str) -> LocalStateChanged:
        return LocalStateChanged(
            f"the local state {self.state_dir}: {what}; it is not uploaded or resumed from — remove it (and the later "
            "segments' local states) and rerun: the segment is trained again from the last state in the store"
        )


def _has_link(state_dir: Path, relative: str) -> bool:
    """Whether the state directory or any directory or file on the way to `relative` is a symbolic link."""
    path = state_dir
    if path.is_symlink():
        return True
    for part in relative.split("/"):
        path = path / part
        if path.is_symlink():
            return True
    return False


def make_durable_rename(state_dir: Path) -> None:
    """fsync the directory holding `state_dir`, so that its rename survives a power cut."""
    _fsync(state_dir.parent, directory=True)
