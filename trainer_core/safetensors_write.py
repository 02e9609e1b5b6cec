"""Write named tensors as a safetensors file straight to the disk (`direct_write.DirectFile`), without a copy.

`safetensors.torch.save_file` first copies every tensor into a bytes object,
then writes through the page cache; it has no streaming or O_DIRECT writer.
The format is small and fixed (an 8-byte little-endian header length, a JSON
header padded with spaces to a multiple of 8, then each tensor's bytes in
header order), so this module lays out the header as the library does (its
order: dtypes by the library's rank, largest first, then names) and streams
the tensors after it. `tests/unit/test_safetensors_write.py` pins the result
to the library's own bytes and reads every file back with `safe_open`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

from trainer_core.direct_write import DirectFile

DTYPES: dict[torch.dtype, tuple[str, int]] = {
    # torch dtype: (safetensors name, the library's rank of it: tensors are laid out highest rank first)
    torch.bool: ("BOOL", 0),
    torch.uint8: ("U8", 1),
    torch.int8: ("I8", 2),
    torch.float8_e5m2: ("F8_E5M2", 3),
    torch.float8_e4m3fn: ("F8_E4M3", 4),
    torch.int16: ("I16", 5),
    torch.uint16: ("U16", 6),
    torch.float16: ("F16", 7),
    torch.bfloat16: ("BF16", 8),
    torch.int32: ("I32", 9),
    torch.uint32: ("U32", 10),
    torch.float32: ("F32", 11),
    torch.float64: ("F64", 12),
    torch.int64: ("I64", 13),
    torch.uint64: ("U64", 14),
}
HEADER_ALIGN = 8


def _layout(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    unsupported = sorted({str(t.dtype) for t in tensors.values() if t.dtype not in DTYPES})
    if unsupported:
        raise ValueError(f"safetensors has no dtype for {unsupported}; convert those tensors before saving")
    return sorted(tensors, key=lambda name: (-DTYPES[tensors[name].dtype][1], name))


def safetensors_header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """The file's first bytes: the header's length and the header (offsets of each tensor's bytes after it)."""
    header: dict[str, object] = {}
    if bad := sorted(
        key for key, value in (metadata or {}).items() if not isinstance(key, str) or not isinstance(value, str)
    ):
        raise TypeError(f"safetensors metadata must map str to str; {bad} do not (json.dumps the values first)")
    if metadata:
        header["__metadata__"] = dict(sorted(metadata.items()))
    offset = 0
    for name in _layout(tensors):
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": DTYPES[tensor.dtype][0],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % HEADER_ALIGN)
    return struct.pack("<Q", len(text)) + text


def write_safetensors(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> int:
    """Write `tensors` (CPU or not, any layout) to `path` as safetensors; returns the file's size in bytes."""
    header = safetensors_header(tensors, metadata)  # refuses what it cannot hold before a file exists
    with DirectFile(path) as out:
        out.write(header)
        for name in _layout(tensors):
            out.write_tensor(tensors[name])
        size = out.size
    return size
