"""Offloaded backward state: saved tensors move to host memory or to a file.

Installed with `torch.autograd.graph.saved_tensors_hooks` around a forward.
Tensors that share storage with a parameter are kept by reference: copying the
weights into every graph would cost more than it saves. On CUDA the host copy
is pinned so it moves back asynchronously; on a CPU-only machine "host" is the
same memory, so `disk` is the target that actually frees it.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from typing import Literal

import torch

OffloadTarget = Literal["host", "disk"]


class OffloadHooks:
    def __init__(self, target: OffloadTarget, keep_storages: set[int], directory: str | None = None):
        self.target = target
        self._keep = keep_storages
        self._directory = directory
        self._files: list[str] = []
        # Several autograd nodes often save the very same tensor; move it once.
        self._packed: dict[tuple, tuple] = {}
        self.offloaded_bytes = 0

    def _storage_key(self, tensor: torch.Tensor) -> int:
        return tensor.untyped_storage().data_ptr()

    def pack(self, tensor: torch.Tensor):
        if self._storage_key(tensor) in self._keep or tensor.numel() == 0:
            return ("ref", tensor)  # parameters: referenced, not copied
        key = (self._storage_key(tensor), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        cached = self._packed.get(key)
        # The weak reference proves it is the same tensor, not a new one that
        # the allocator placed at a freed address.
        if cached is not None and cached[0]() is tensor and cached[1] == tensor._version:
            return cached[2]
        packed = self._move_out(tensor)
        self._packed[key] = (weakref.ref(tensor), tensor._version, packed)
        return packed

    def _move_out(self, tensor: torch.Tensor):
        num_bytes = tensor.numel() * tensor.element_size()
        self.offloaded_bytes += num_bytes
        if self.target == "host":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            host.copy_(tensor, non_blocking=tensor.is_cuda)
            return ("host", tensor.device, host)
        if self._directory is None:
            self._directory = tempfile.mkdtemp(prefix="rankflow-offload-")
        path = os.path.join(self._directory, f"{len(self._files)}.pt")
        torch.save(tensor.detach().cpu().contiguous(), path)
        self._files.append(path)
        return ("disk", tensor.device, path)

    def unpack(self, packed):
        kind = packed[0]
        if kind == "ref":
            return packed[1]
        if kind == "host":
            return packed[2].to(packed[1], non_blocking=True)
        return torch.load(packed[2], weights_only=True).to(packed[1])

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def release(self) -> None:
        for path in self._files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._files.clear()
        self._packed.clear()
        if self._directory is not None:
            try:
                os.rmdir(self._directory)
            except OSError:
                pass
