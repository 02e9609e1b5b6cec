"""Offloaded backward state: saved tensors move to host memory or to a file, and come back in backward.

Installed with `torch.autograd.graph.saved_tensors_hooks` around a forward.
Tensors that share storage with a parameter are kept by reference (copying the
weights into every graph would cost more than it saves) — as a detached alias,
never the saved tensor itself, so no reference cycle through C++ can form.
Because hooks switch off autograd's own version check, the check is done here:
a parameter changed in place before backward raises PyTorch's error; a copied
tensor (an input buffer, an activation) is restored with the values the
forward saw. On CUDA the host copy is pinned so it moves back asynchronously;
on a CPU-only machine "host" is the same memory, so `disk` is the target that
actually frees it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from typing import ClassVar, Literal

import torch

from .base import BackwardMode, inplace_error
from .retained import RetainedGraph

OffloadTarget = Literal["host", "disk"]


class OffloadHooks:
    def __init__(self, target: OffloadTarget, keep_storages: set[int], directory: str | None = None):
        self.target = target
        self._keep = keep_storages
        self._directory = directory
        self._owns_directory = directory is None
        self._files: list[str] = []
        # Several autograd nodes often save the very same tensor; move it once.
        self._packed: dict[tuple, tuple] = {}
        self.offloaded_bytes = 0

    def pack(self, tensor: torch.Tensor):
        storage_key = tensor.untyped_storage().data_ptr()
        if storage_key in self._keep or tensor.numel() == 0:
            return ("ref", tensor.detach(), tensor._version)  # parameters: referenced, not copied
        key = (storage_key, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        cached = self._packed.get(key)
        # The weak reference proves it is the same tensor, not a new one that
        # the allocator placed at a freed address.
        if cached is not None and cached[0]() is tensor and cached[1] == tensor._version:
            return cached[2]
        packed = self._move_out(tensor)
        self._packed[key] = (weakref.ref(tensor), tensor._version, packed)
        return packed

    def _move_out(self, tensor: torch.Tensor):
        self.offloaded_bytes += tensor.numel() * tensor.element_size()
        if self.target == "host":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            host.copy_(tensor, non_blocking=tensor.is_cuda)
            return ("host", tensor.device, host)
        if self._directory is None:
            self._directory = tempfile.mkdtemp(prefix="rankflow-offload-")
        path = os.path.join(self._directory, f"{len(self._files)}.pt")
        self._files.append(path)
        torch.save(tensor.detach().cpu().contiguous(), path)
        return ("disk", tensor.device, path)

    @staticmethod
    def unpack(packed):
        kind = packed[0]
        if kind == "ref":
            alias, version = packed[1], packed[2]
            if alias._version != version:
                raise inplace_error(f"{alias.dtype} parameter", tuple(alias.shape), version, alias._version)
            return alias
        if kind == "host":
            return packed[2].to(packed[1], non_blocking=True)
        return torch.load(packed[2], weights_only=True).to(packed[1])

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def release(self) -> None:
        self._packed.clear()
        for path in self._files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._files.clear()
        if self._directory is not None and self._owns_directory:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None


class OffloadedGraph(RetainedGraph):
    """Autograd's graph, its saved tensors moved out by `OffloadHooks` and read back in backward."""

    mode: ClassVar[BackwardMode] = "offload"

    def __init__(self, outputs: dict[str, torch.Tensor], hooks: OffloadHooks, resident_bytes: int):
        super().__init__(outputs, resident_bytes)
        self._hooks = hooks

    @classmethod
    def record(cls, run: Callable[[], dict[str, torch.Tensor]], target: OffloadTarget, parameter_storages: set[int],
               on_cuda: bool) -> tuple["OffloadedGraph", dict]:
        hooks = OffloadHooks(target, parameter_storages)
        with hooks.hooks():
            values = run()
        # Host offload on a CPU device moves nothing out of device memory.
        resident = hooks.offloaded_bytes if target == "host" and not on_cuda else 0
        return cls(values, hooks, resident), values

    @property
    def offloaded_bytes(self) -> int:
        return self._hooks.offloaded_bytes

    def release(self) -> None:
        super().release()
        self._hooks.release()
