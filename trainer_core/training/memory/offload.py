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

For the memory planner, the hooks can time each pack and each restore on its
own (`CopyTimer`: CUDA events around each copy, the host clock on the CPU) —
never the forward around them — and count the bytes a retained graph would
have kept (distinct storages, parameters excluded, as `saved_tensor_bytes`
counts them).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from typing import ClassVar

import torch

from .base import ForwardRecording, inplace_error
from .costs import Evidence, OffloadTarget, PlanInputs
from .retained import RetainedGraph
from .timing import CopyTimer


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's elements (contiguous first): any dtype, bf16 included, as raw bytes."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _in_memory_order(tensor: torch.Tensor) -> torch.Tensor:
    """The elements of a dense tensor as they lie in memory (made by empty_like: its storage holds just them)."""
    return tensor.as_strided((tensor.numel(),), (1,))


class OffloadHooks:
    def __init__(
        self,
        target: OffloadTarget,
        keep_storages: set[int],
        directory: str | None = None,
        *,
        timed: bool = False,
        keep_impls: frozenset[int] = frozenset(),
    ):
        """`keep_storages`: data_ptrs of weights, `keep_impls`: StorageImpl ids of weights whose data_ptr moves
        (a sharded engine's gathered parameters): tensors on either are referenced, not copied."""
        self.target: OffloadTarget = target
        self._keep = keep_storages
        self._keep_impls = keep_impls
        self._directory = directory
        self._owns_directory = directory is None
        self._files: list[str] = []
        # Several autograd nodes often save the very same tensor; move it once.
        self._packed: dict[tuple, tuple] = {}
        self.offloaded_bytes = 0
        self._storages: dict[int, weakref.ref] = {}
        self._retained_equivalent_bytes = 0
        self.pack_timer, self.restore_timer = CopyTimer(timed), CopyTimer(timed)
        self.restored_bytes = 0

    @property
    def retained_equivalent_bytes(self) -> int:
        """What retaining this graph would have kept resident: the distinct storages of the saved tensors."""
        return self._retained_equivalent_bytes

    def _count_storage(self, tensor: torch.Tensor, storage) -> None:
        # An address names a storage only while a tensor on it lives: retain would have kept every saved
        # storage alive, but here a freed one's address can come back for a new storage, which counts again.
        # A view's base lives at least as long as the view, so it is the better witness of the storage.
        owner = tensor._base if tensor._base is not None else tensor
        seen = self._storages.get(storage.data_ptr())
        if seen is None or seen() is None:
            self._retained_equivalent_bytes += storage.nbytes()
            self._storages[storage.data_ptr()] = weakref.ref(owner)

    def pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        storage_key = storage.data_ptr()
        if storage_key in self._keep or storage._cdata in self._keep_impls or tensor.numel() == 0:
            return ("ref", tensor.detach(), tensor._version)  # parameters: referenced, not copied
        self._count_storage(tensor, storage)
        key = (storage_key, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        cached = self._packed.get(key)
        # The weak reference proves it is the same tensor, not a new one that
        # the allocator placed at a freed address.
        if cached is not None and cached[0]() is tensor and cached[1] == tensor._version:
            return cached[2]
        with self.pack_timer.timing(tensor.device):
            packed = self.move_out(tensor)
        self._packed[key] = (weakref.ref(tensor), tensor._version, packed)
        return packed

    def move_out(self, tensor: torch.Tensor):
        """Copy `tensor` to the target; `unpack` brings it back (also used for a replay's input copies)."""
        self.offloaded_bytes += tensor.numel() * tensor.element_size()
        # The copy keeps the saved tensor's strides (empty_like's preserve_format; contiguous where they are not
        # dense): backward's kernels then see the layout the forward saved, so they round as a retained graph's do
        # (a transposed operand restored contiguous takes another GEMM path: last-bit different gradients).
        host = torch.empty_like(tensor, device="cpu", pin_memory=tensor.is_cuda and self.target == "host")
        host.copy_(tensor, non_blocking=tensor.is_cuda and self.target == "host")
        if self.target == "host":
            return ("host", tensor.device, host)
        if self._directory is None:
            self._directory = tempfile.mkdtemp(prefix="rankflow-offload-")
        path = os.path.join(self._directory, f"{len(self._files)}.bin")
        self._files.append(path)
        # Raw bytes in memory order, no pickling: half the time of torch.save, and read back with one readinto.
        with open(path, "wb") as file:
            file.write(_bytes_of(_in_memory_order(host)).numpy().data)
        return ("disk", tensor.device, (path, tuple(host.shape), host.stride(), host.dtype))

    def unpack(self, packed):
        kind, device = packed[0], packed[1]
        if kind == "ref":
            alias, version = packed[1], packed[2]
            if alias._version != version:
                raise inplace_error(f"{alias.dtype} parameter", tuple(alias.shape), version, alias._version)
            return alias
        with self.restore_timer.timing(device):
            if kind == "host":
                restored = packed[2].to(device, non_blocking=True)
            else:
                path, shape, stride, dtype = packed[2]
                flat = torch.empty(_numel(shape), dtype=dtype)
                with open(path, "rb") as file:
                    file.readinto(_bytes_of(flat).numpy().data)
                restored = flat.as_strided(shape, stride).to(device)
        self.restored_bytes += restored.numel() * restored.element_size()
        return restored

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def take_restore_measurement(self) -> tuple[int, float]:
        """Bytes restored and seconds spent restoring since the last call (a backward's worth)."""
        num_bytes, self.restored_bytes = self.restored_bytes, 0
        return num_bytes, self.restore_timer.take()

    def release(self) -> None:
        self._packed.clear()
        self._storages.clear()
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

    mode: ClassVar[str] = "offload"
    replays: ClassVar[bool] = False
    is_default: ClassVar[bool] = False
    planned: ClassVar[bool] = True
    exploration_rank: ClassVar[int | None] = 0
    exploration_reason: ClassVar[str] = "offload keeps nothing and measures the bytes"
    cheaper_reason: ClassVar[str] = "offload is cheaper"
    cost_key: ClassVar[str] = "offload_s"
    """The planner's records name this mode's cost so."""
    tie_rank: ClassVar[int] = 1
    """Of two modes that cost the same, the one of lower rank is chosen."""
    last_resort: ClassVar[bool] = True
    """Chosen when no other mode keeps within the budget: to disk, it keeps nothing on the device."""

    def __init__(self, outputs: dict[str, torch.Tensor], hooks: OffloadHooks, resident_bytes: int):
        super().__init__(outputs, resident_bytes)
        self._hooks = hooks

    @classmethod
    def record(cls, forward: ForwardRecording) -> tuple["OffloadedGraph", dict]:
        target = forward.offload_target
        hooks = OffloadHooks(
            target, forward.parameter_storages(), timed=forward.measuring, keep_impls=forward.weight_impls()
        )
        try:
            with hooks.hooks():
                values = forward.timed()
        except BaseException:  # what was packed before the failure goes now: no graph will ever own it
            hooks.release()
            raise
        # Host offload on a CPU device moves nothing out of device memory.
        resident = hooks.offloaded_bytes if target == "host" and not forward.call.input_ids.is_cuda else 0
        return cls(values, hooks, resident), values

    def forward_evidence(self, forward_s: float) -> Evidence:
        # The watch timed the packs too: what a forward costs is the rest.
        pack_s = self._hooks.pack_timer.take()
        return Evidence(
            forward_s=forward_s - pack_s,
            saved_bytes=self._hooks.retained_equivalent_bytes,
            pack=(self._hooks.offloaded_bytes, pack_s),
        )

    def backward_evidence(self) -> Evidence:
        return Evidence(restore=self._hooks.take_restore_measurement())

    def stale_replay_stash(self) -> OffloadHooks:
        # Its replay's input copies go where its saved tensors went: it keeps nothing resident either.
        return OffloadHooks(self._hooks.target, set())

    # -- the planner's cost model --

    @classmethod
    def available(cls, inputs: PlanInputs) -> bool:
        return inputs.offload_frees

    @classmethod
    def unavailable_reason(cls, inputs: PlanInputs) -> str:
        return f"{inputs.offload_target} offload frees no device memory here"

    @classmethod
    def last_resort_reason(cls, inputs: PlanInputs) -> str:
        return cls.unavailable_reason(inputs) + ": offload to disk"

    @classmethod
    def placement(cls, inputs: PlanInputs) -> OffloadTarget:
        """Where its tensors go: the trainer's target, or disk where that frees nothing."""
        return inputs.offload_target if inputs.offload_frees else "disk"

    @classmethod
    def planned_bytes(cls, inputs: PlanInputs) -> float:
        return 0.0

    @classmethod
    def extra_seconds(cls, inputs: PlanInputs) -> float:
        assert inputs.estimate is not None
        return inputs.estimate * inputs.copy_s_per_byte

    @property
    def offloaded_bytes(self) -> int:
        return self._hooks.offloaded_bytes

    @property
    def offload_hooks(self) -> OffloadHooks:
        """The packing hooks: bytes moved, what retaining would have kept, and the copies' timers."""
        return self._hooks

    def release(self) -> None:
        super().release()
        self._hooks.release()
