"""Which files `data.path` names, what type each is, and their digest: local files, or URLs read through fsspec.

`data.path` is one path, a glob (`data/train-*.parquet`, `**` included) or a
list of either; a glob's matches are taken in sorted order, the list's entries
in the order given, and that order is the data order. A file's type comes from
its name: `.parquet` and `.arrow` are read through Hugging Face `datasets`
(trainer_core/data/readers/columnar.py), anything else as JSONL
(trainer_core/data/readers/jsonl.py).

An entry with a scheme (`s3://bucket/data/train.jsonl`, `s3://bucket/data/*.jsonl`,
any URL an installed fsspec filesystem reads) names objects read where they
are, with the credentials the store's own client finds (for S3 the AWS_*
variables, AWS_ENDPOINT_URL included): its files are listed (a glob's
matches, sorted), each must be a file, and each is streamed through the same
readers and checks as a local one, messages naming `URL:LINE`. A bucket or
object that does not exist, or that the credentials may not read, is a
ConfigError naming the key; a store that does not answer is its OSError (an
outage). A name that is neither a local file, a glob with matches nor a URL
(a hub dataset such as `HuggingFaceH4/ultrachat_200k`) is a ConfigError with
the command that fetches it. This module is imported by the config's checks,
so it lives outside `trainer_core.data` (whose package imports torch for the
data stages) and imports nothing heavy (no `datasets`, no pyarrow; fsspec
only for a URL).
"""

from __future__ import annotations

import errno
import glob
import hashlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from .errors import ConfigError
from .input_files import open_input, open_url, resolved_path

FileType = Literal["jsonl", "parquet", "arrow"]
DataPath = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]

_WHAT = "a JSONL file, or at Parquet or Arrow files (a path or URL, a list of them or a glob)"
FIX = f"point data.path at {_WHAT}"


def fix_for(key: str) -> str:
    """The fix a message about `key` (data.path or data.eval_path) names."""
    return f"point {key} at {_WHAT}"


_COLUMNAR_SUFFIXES: dict[str, FileType] = {".parquet": "parquet", ".arrow": "arrow"}
_GLOB_CHARACTERS = re.compile(r"[*?[]")
# `owner/name` with the characters the hub allows: how a hub dataset is named (a relative path can look the same).
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class DataFile:
    """One input file and how its records are counted in messages (JSONL lines from 1, rows from 0)."""

    path: Path | str
    """A local path, or a URL (`s3://…`) read through fsspec."""
    type: FileType
    key: str = "data.path"
    """The setting that named the file (data.path, or data.eval_path): what a message about it names."""

    def where(self, position: int) -> str:
        """`FILE:LINE` for JSONL, `FILE:row N` for Parquet and Arrow (the row index `datasets` and pandas use)."""
        return f"{self.path}:{position}" if self.type == "jsonl" else f"{self.path}:row {position}"

    def open(self):
        """The file through `open_input` (a FIFO, a device or an unreadable file fails by name, never blocks), or a
        URL's object through fsspec (`open_url`)."""
        label, fix = f"{self.key}={str(self.path)!r}", fix_for(self.key)
        return open_url(self.path, label, fix) if isinstance(self.path, str) else open_input(self.path, label, fix)

    def sha256(self) -> str:
        digest = hashlib.sha256()
        with self.open() as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        return digest.hexdigest()


def file_type(path: Path | str) -> FileType:
    return _COLUMNAR_SUFFIXES.get(PurePosixPath(path).suffix.lower(), "jsonl")


def entries(path: DataPath) -> list[str]:
    """The entries of a `data.path` setting: one path, or each of a list's."""
    return [os.fspath(path)] if isinstance(path, (str, os.PathLike)) else [os.fspath(p) for p in path]


def describe(path: DataPath) -> str:
    """`data.path` as a message names it."""
    names = entries(path)
    return names[0] if isinstance(path, (str, os.PathLike)) else f"[{', '.join(names)}]"


def resolve_entry(entry: str, config_dir: Path, key: str = "data.path") -> str:
    """An entry made absolute against the config's directory (a `file://` URL is a path too); another URL is left as
    given."""
    entry = entry.removeprefix("file://")  # read as a local path: open_input's checks, not fsspec's
    if "://" in entry:
        return entry
    return str(resolved_path(config_dir / Path(entry).expanduser(), key, fix_for(key)))


def _not_found(entry: str, given: str, key: str) -> ConfigError:
    problem = "matches no file" if _GLOB_CHARACTERS.search(entry) else "does not exist"
    hub = ""
    if _HUB_NAME.match(given) and not given.startswith("."):
        hub = (
            f"; if {given!r} names a Hugging Face hub dataset: rankflow does not download datasets, so download it "
            f"first (hf download {given} --repo-type dataset --local-dir DIR) and point {key} at its files, "
            "e.g. a glob such as DIR/data/*.parquet"
        )
    return ConfigError(f"{key}={entry!r} {problem}; point it at {_WHAT}{hub}")


def _no_credentials(error: BaseException) -> bool:
    """Whether botocore found no usable credentials (none at all, or half a key pair): the user's setting, not an
    outage. By name: botocore is s3fs's, not imported here."""
    names = {kind.__name__ for kind in type(error).__mro__}
    return bool(names & {"NoCredentialsError", "PartialCredentialsError"})


def _expand_url(entry: str, key: str) -> list[str]:
    """The objects a URL (or a URL glob) names, as URLs, sorted; a ConfigError when there are none or one is not a
    file. A store that does not answer raises its OSError."""
    import fsspec

    fix = fix_for(key)
    scheme = entry.split("://", 1)[0]
    try:
        fs, path = fsspec.core.url_to_fs(entry, skip_instance_cache=True)
    except (ValueError, ImportError) as error:  # no filesystem for the scheme, or its package is missing
        raise ConfigError(
            f"{key}={entry!r}: no installed fsspec filesystem reads {scheme}:// URLs ({' '.join(str(error).split())}); "
            f"install the one that does (s3:// comes with rankflow), or {fix}"
        ) from None
    try:
        if _GLOB_CHARACTERS.search(path):
            matches = sorted(found for found in fs.glob(path) if fs.isfile(found))
            if not matches:
                raise ConfigError(f"{key}={entry!r} matches no object; {fix}")
            return [fs.unstrip_protocol(found) for found in matches]
        info = fs.info(path)
    except FileNotFoundError:
        raise ConfigError(f"{key}={entry!r} does not exist (no such object or bucket); {fix}") from None
    except PermissionError as error:
        raise ConfigError(
            f"{key}={entry!r} cannot be read with the store's credentials ({error}); give them read access to it "
            f"(for S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL), or {fix}"
        ) from None
    except Exception as error:  # noqa: BLE001 - only botocore's "no usable credentials" is translated here
        if not _no_credentials(error):
            raise
        raise ConfigError(
            f"{key}={entry!r} cannot be read: no usable credentials ({' '.join(str(error).split())}); set "
            f"AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for an endpoint other than AWS), "
            f"or {fix}"
        ) from None
    if info.get("type") != "file":
        raise ConfigError(f"{key}={entry!r} is a directory (a prefix), not a file; name its files or a glob: {fix}")
    return [entry]


def _expand(entry: str, given: str, key: str) -> list[Path | str]:
    fix = fix_for(key)
    entry = entry.removeprefix("file://")  # a local path: open_input's checks, not fsspec's
    if entry.startswith("hf://"):
        # A hub dataset would be fetched again by every plan, at whatever its revision has become: fetched once.
        raise ConfigError(
            f"{key}={entry!r} is a URL of the Hugging Face hub; rankflow does not read the hub's datasets in place: "
            f"download the data first (hf download NAME --repo-type dataset --local-dir DIR) and {fix}"
        )
    if "://" in entry:
        urls: list[Path | str] = [*_expand_url(entry, key)]
        return urls
    path = Path(entry)
    try:
        os.stat(path)
        return [path]  # an existing file is taken as named, even with [ or * in its name
    except FileNotFoundError:
        pass
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ConfigError(
                f"{key}={entry!r} is a symbolic link that loops (or has too many levels); {fix}"
            ) from None
        raise ConfigError(f"{key}={entry!r} cannot be read ({error.strerror}); {fix}") from None
    if os.path.lexists(path) and path.is_symlink():
        raise ConfigError(f"{key}={entry!r} is a symbolic link to nothing ({os.readlink(path)!r}); {fix}")
    matches = sorted(glob.glob(entry, recursive=True)) if _GLOB_CHARACTERS.search(entry) else []
    if not matches:
        raise _not_found(entry, given, key)
    return [Path(match) for match in matches]


def data_files(path: DataPath, given: DataPath | None = None, key: str = "data.path") -> list[DataFile]:
    """The files `path` (a resolved `data.path`) names, in data order; a ConfigError says what is missing and the fix.

    `given` is the setting as the user wrote it (before it was made absolute),
    so that a hub name is recognised as such in the message.
    """
    resolved, written = entries(path), entries(given if given is not None else path)
    if not resolved:
        raise ConfigError(f"{key}=[] names no file; {fix_for(key)}")
    files = []
    for entry, as_given in zip(resolved, written, strict=True):
        files += [DataFile(found, file_type(found), key) for found in _expand(entry, as_given, key)]
    return files


def data_digest(files: Sequence[DataFile]) -> str | list[str]:
    """What the plan's fingerprint holds for the data: one file's sha256 (as before lists existed), or each file's."""
    digests = [file.sha256() for file in files]
    return digests[0] if len(digests) == 1 else digests
