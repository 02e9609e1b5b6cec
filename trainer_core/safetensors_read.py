"""Read a whole safetensors file straight from the disk (O_DIRECT) into memory the process owns.

`safe_open(...).get_tensor` hands out tensors backed by a private
(copy-on-write) map of the file. For the AdamW moments, which the first
optimizer step writes in place, that is the slow path twice over: every page
is read into the page cache, then copied again by a page fault when the step
first writes it. On this project's CI machines the copy-on-write alone
added 0.6–0.7 s to the first step of a 2 GB state (1.3 GB of moments), and
filling the page cache ran at 0.3–1.2 GB/s against a steady 1.3–1.5 GB/s
for O_DIRECT reads of the same freshly written files (`bench.boundary`).

Here the library still opens and validates the file (header, dtypes, shapes,
offsets within the file). Then the whole file is read with O_DIRECT, in
large aligned reads, into one page-aligned anonymous buffer, and each tensor
is a view of its bytes in it: no page cache, no map of the file, no copy.
The library has no API to read into memory the caller owns. A filesystem
that refuses O_DIRECT (tmpfs, some network filesystems) is read the same way
through its cache.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from trainer_core.direct_write import BLOCK_BYTES
from trainer_core.safetensors_write import DTYPES

_TORCH_DTYPES = {name: dtype for dtype, (name, _rank) in DTYPES.items()}
READ_BYTES = 64 * 2**20
"""Bytes per read call: a disk's full rate, and below Linux's 2 GB cap on one read."""


def _open(path: Path, direct: bool) -> int:
    # O_NOFOLLOW: a link planted where a state file is must not be read in its place (as the writer refuses it).
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    return os.open(path, flags | (getattr(os, "O_DIRECT", 0) if direct else 0))


def _identity(status: os.stat_result) -> tuple[int, int, int, int]:
    """What a write to the file changes: its size and times, to the kernel's clock tick (and which file it is)."""
    return status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns


def _read_whole(path: Path, buffer: mmap.mmap, size: int, direct: bool) -> None:
    """`size` bytes of `path` into `buffer` (page-aligned, whole blocks long), O_DIRECT where asked and the file
    system takes it (EINVAL at the open or at a read: through the cache)."""
    direct = direct and bool(getattr(os, "O_DIRECT", 0))
    try:
        descriptor = _open(path, direct)
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
        direct, descriptor = False, _open(path, False)
    try:
        opened = _identity(os.fstat(descriptor))
        done = 0
        with memoryview(buffer) as whole:
            while done < size:
                with whole[done : min(len(whole), done + READ_BYTES)] as target:
                    try:
                        count = os.preadv(descriptor, [target], done)
                    except OSError as error:
                        if not (direct and error.errno == errno.EINVAL):
                            raise
                        os.close(descriptor)  # O_DIRECT accepted at the open, refused at the read
                        descriptor = -1  # never closed twice: the number may be another thread's file by now
                        direct, descriptor = False, _open(path, False)
                        continue
                if count == 0:
                    raise EOFError(f"{path} ends at byte {done}, before byte {size} it held when opened")
                done += count
        if _identity(os.fstat(descriptor)) != opened:  # written while read: the bytes may mix two versions
            raise ValueError(f"{path} changed while it was read (written to during the read); read it again")
    finally:
        if descriptor >= 0:
            os.close(descriptor)


Layouts = dict[str, tuple[torch.dtype, list[int]]]
"""Each tensor's dtype and shape, by name."""


def only_reader_on_this_node() -> bool:
    """Whether this process is the only one of its launch on this node (torchrun's LOCAL_WORLD_SIZE; 1 outside
    torchrun). Several replicas each read the whole file: through the page cache the disk serves them once."""
    return os.environ.get("LOCAL_WORLD_SIZE", "1") == "1"


def check_safetensors(path: Path) -> tuple[Layouts, dict[str, str]]:
    """(each tensor's dtype and shape, the metadata), from the library's validation of the file (header, dtypes,
    shapes, offsets within the file); a damaged file, or a link in its place, is refused with an error naming it."""
    if path.is_symlink():  # the read opens with O_NOFOLLOW: refused here, before a restore has changed anything
        raise ValueError(f"{path} is a symbolic link; a state's files are its own: copy the file there instead")
    try:
        with safe_open(str(path), framework="pt") as checked:
            metadata = checked.metadata() or {}
            layouts = {
                name: (checked.get_slice(name).get_dtype(), checked.get_slice(name).get_shape())
                for name in checked.keys()
            }
    except SafetensorError as damaged:
        raise ValueError(f"{path} is not a whole safetensors file ({damaged}); it was cut short or changed") from None
    if unknown := sorted(f"{name} ({dtype})" for name, (dtype, _) in layouts.items() if dtype not in _TORCH_DTYPES):
        raise ValueError(f"{path}: tensors {unknown} have dtypes rankflow does not save")
    return {name: (_TORCH_DTYPES[dtype], list(shape)) for name, (dtype, shape) in layouts.items()}, metadata


SMALL_TENSOR_BYTES = 4096
"""Tensors at most this large (AdamW's `step`) get memory of their own: a view would keep the whole buffer alive
after the moments moved to a GPU."""


def _header_as_checked(buffer: mmap.mmap, size: int, layouts: Layouts) -> tuple[dict, int] | None:
    """The header read with the bytes and where its data start, if it names the tensors the check gave, each with
    its dtype, shape and a byte range of that size within the file; None if not (the file changed between the
    check and the read)."""
    try:
        (length,) = struct.unpack_from("<Q", buffer, 0)
        header = json.loads(buffer[8 : 8 + length])
        if sorted(name for name in header if name != "__metadata__") != sorted(layouts):
            return None
        for name, (dtype, shape) in layouts.items():
            entry = header[name]
            start, end = entry["data_offsets"]
            if (
                entry["dtype"] != DTYPES[dtype][0]
                or list(entry["shape"]) != list(shape)
                or end - start != math.prod(shape) * dtype.itemsize
                or not 0 <= start <= end <= size - 8 - length
            ):
                return None
    except (ValueError, KeyError, TypeError, struct.error):  # not JSON, not a header: not the file checked
        return None
    return header, 8 + length


def read_safetensors(
    path: Path, *, direct: bool = True, checked: Layouts | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(every tensor of `path`, views of one buffer of the process's own, the file's metadata). `direct`: past the
    page cache (O_DIRECT), else through it; either way into memory the caller owns. `checked`: the layouts
    `check_safetensors` gave for this file already (the bytes read are held to them all the same)."""
    layouts = checked if checked is not None else check_safetensors(path)[0]
    size = path.stat().st_size
    # MAP_PRIVATE: ordinary anonymous memory (Python's default is a shared map: shmem, not reclaimable as such).
    buffer = mmap.mmap(
        -1, max(BLOCK_BYTES, -(-size // BLOCK_BYTES) * BLOCK_BYTES), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )
    _read_whole(path, buffer, size, direct)
    as_checked = _header_as_checked(buffer, size, layouts)
    if as_checked is None:
        raise ValueError(f"{path} changed while it was read (its tensors are not those it held); read it again")
    header, data_start = as_checked
    tensors: dict[str, torch.Tensor] = {}
    for name, (dtype, shape) in layouts.items():
        start, end = header[name]["data_offsets"]
        if end == start:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=end - start, offset=data_start + start)
        tensor = raw.view(dtype).reshape(shape)
        tensors[name] = tensor.clone() if end - start <= SMALL_TENSOR_BYTES else tensor
    return tensors, header.get("__metadata__") or {}
