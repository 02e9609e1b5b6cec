"""Reading a stored DCP state (`fsdp.checkpoint_io`) without trusting what its files say.

A sharded state comes back from the store verified against its bundle's
manifest (infra/runs/run_state.py), but whoever can write the store can write
that manifest too: the digests prove the bytes are the writer's, not that the
writer is friendly. `torch.distributed.checkpoint` trusts its files whole:

- `.metadata` is a pickle, which `FileSystemReader` unpickles as it is:
  whatever callable the file names would run. It is read here by an
  unpickler that builds DCP's own metadata types and what they hold (sizes,
  dtypes, layouts, a path) and refuses any other global.
- its `storage_data` names, for each item, the file holding it, relative to
  the state's `dcp/` directory, and DCP opens `dcp/NAME` as given: `../x` or
  an absolute path would read any file on the machine into the weights. Every
  name must be a plain file name (no separator, not `.` or `..`), of a
  regular file in that directory (never a symbolic link), holding the byte
  range the item says it is at.
- bytes items (the optimizer's param groups) are `torch.load`ed with
  `weights_only=False`; here with `weights_only=True`, which builds plain
  values only.

All of it is checked when DCP asks for the metadata, before it opens any file
the metadata names. A refusal is a ValueError naming the state and the name,
as for any damaged stored state (the run fails the stage, not retried: the
same bytes would be refused again).
"""

from __future__ import annotations

import io
import os
import pickle
import stat
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

__all__ = ["METADATA_FILE", "CheckedReader", "PlainValuesPlanner", "checked_metadata", "stored_metadata"]

METADATA_FILE = ".metadata"
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = {
    *(
        (_METADATA_MODULE, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id: where the state was written
    ("pathlib", "PurePosixPath"),
    ("pathlib._local", "PosixPath"),  # Python 3.13 pickles pathlib's classes from their new module
    ("pathlib._local", "PurePosixPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds only what a DCP `.metadata` holds (pickle's own "restricting globals")."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is no part of a DCP metadata file")


def _refused(dcp_dir: Path, why: str) -> ValueError:
    return ValueError(
        f"the sharded state in {dcp_dir.parent} cannot be read ({why}): its files are damaged, incomplete or not "
        "what a trainer wrote, and nothing of it was loaded; resume from the stored run-state bundle, whose digests "
        "are verified (where that is refused too, delete its manifest, RUN_ID/run-state/segment-NNNN.json, to "
        "train that segment again from the one before)"
    )


def _regular_file(dcp_dir: Path, name: str) -> os.stat_result | None:
    """The file's stat if `dcp_dir/name` is a regular file (lstat: a symbolic link is none), else None."""
    try:
        found = (dcp_dir / name).lstat()
    except FileNotFoundError:
        return None
    return found if stat.S_ISREG(found.st_mode) else None


def _plain_name(dcp_dir: Path, name: object) -> str:
    """`name` if it names a file directly inside `dcp_dir`; the refusal otherwise."""
    if not isinstance(name, str) or name in ("", ".", "..", METADATA_FILE) or any(c in name for c in "/\\\x00"):
        raise _refused(dcp_dir, f"its metadata names the shard file {name!r}, which is no plain file name in it")
    return name


def stored_metadata(dcp_dir: Path) -> Metadata:
    """The state's DCP metadata, unpickled safely, every shard file it names a plain file name (checked, not opened).

    ValueError when the metadata is no regular file, names anything but DCP's types, or names a file outside."""
    if _regular_file(dcp_dir, METADATA_FILE) is None:
        raise _refused(dcp_dir, f"{dcp_dir / METADATA_FILE} is missing or is no regular file")
    try:
        with (dcp_dir / METADATA_FILE).open("rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
    except Exception as error:  # noqa: BLE001 - hostile bytes raise anything; each is the same refusal
        raise _refused(dcp_dir, f"its {METADATA_FILE} does not read ({type(error).__name__}: {error})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise _refused(dcp_dir, f"its {METADATA_FILE} holds no DCP metadata")
    for info in metadata.storage_data.values():
        if not isinstance(info, _StorageInfo):
            raise _refused(dcp_dir, f"its {METADATA_FILE} places an item in no file")
        _plain_name(dcp_dir, info.relative_path)
    return metadata


def checked_metadata(dcp_dir: Path) -> Metadata:
    """`stored_metadata`, and every item inside a regular file of `dcp_dir` that holds its byte range."""
    metadata = stored_metadata(dcp_dir)
    sizes: dict[str, int] = {}
    for info in metadata.storage_data.values():
        name = info.relative_path
        if name not in sizes:
            found = _regular_file(dcp_dir, name)
            if found is None:
                raise _refused(dcp_dir, f"its shard file {name} is missing or is no regular file (a link is refused)")
            sizes[name] = found.st_size
        offset, length = info.offset, info.length
        if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset and 0 <= length):
            raise _refused(dcp_dir, f"its metadata gives an item of {name} at {offset!r}, {length!r} bytes")
        if offset + length > sizes[name]:
            raise _refused(dcp_dir, f"{name} holds {sizes[name]} bytes, not the {offset + length} its metadata says")
        if info.transform_descriptors:  # never written here (no compression): an extension DCP would run
            raise _refused(dcp_dir, f"its metadata gives {name} transforms {info.transform_descriptors!r}")
    return metadata


class CheckedReader(FileSystemReader):
    """DCP's file reader, its metadata read by `checked_metadata` (a refusal is kept in `refusal`)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.refusal: ValueError | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            # DCP's fallback after a refused `.metadata`: a rank-local one is never written here, nor read.
            raise self.refusal or ValueError("a sharded state has no rank-local metadata")
        try:
            metadata = checked_metadata(Path(self.path))
        except ValueError as refusal:
            self.refusal = refusal
            raise
        if metadata.storage_meta is None:  # as FileSystemReader.read_metadata does after its load
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class PlainValuesPlanner(DefaultLoadPlanner):
    """DCP's load planner, its bytes items read with the weights-only unpickler."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:  # noqa: ANN001 - DCP's ReadItem
        # DefaultLoadPlanner unpickles with weights_only=False. A training state's bytes items are the optimizer's
        # param groups (floats, bools, tuples, parameter names), which the weights-only unpickler builds; what it
        # built is handed on serialized again, so the planner's own load sees plain values only.
        plain = torch.load(value, map_location="cpu", weights_only=True)
        again = io.BytesIO()
        torch.save(plain, again)
        again.seek(0)
        super().load_bytes(read_item, again)
