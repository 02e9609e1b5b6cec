"""Replayed backward state: keep what the forward saw, and run it again in backward.

What is kept: private copies of the inputs (the caller may refill its batch
buffers after the forward), the CPU/CUDA RNG state (dropout draws the same
masks), the autocast state, every module's train/eval flag (an RL loop may
switch to `eval()` to sample before it backwards), the top-k ids the forward
chose, and the version counter of every parameter — a parameter changed in
place since the forward raises PyTorch's "modified by an inplace operation"
error instead of being replayed at values the forward never saw. The caller's
RNG and module flags are restored after the replay.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..outputs import ForwardCall
from .base import BackwardMode, CotangentsFor, Gradients, Rerun, gradients, inplace_error


@dataclass(frozen=True)
class _RandomAndAutocast:
    cpu_rng: torch.Tensor
    cuda_rng: torch.Tensor | None
    device_type: str
    autocast_enabled: bool
    autocast_dtype: torch.dtype | None

    @classmethod
    def capture(cls, device: torch.device) -> "_RandomAndAutocast":
        device_type = device.type
        cuda_rng = torch.cuda.get_rng_state(device) if device_type == "cuda" else None
        enabled = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type) if enabled else None
        return cls(torch.get_rng_state(), cuda_rng, device_type, enabled, dtype)

    @contextlib.contextmanager
    def restored(self):
        devices = [torch.cuda.current_device()] if self.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu_rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state(self.cuda_rng)
            with torch.autocast(self.device_type, dtype=self.autocast_dtype, enabled=self.autocast_enabled):
                yield


@contextlib.contextmanager
def _training_flags(flags: Sequence[tuple[nn.Module, bool]]):
    """Set every module's train/eval flag as recorded, and put the caller's back afterwards."""
    current = [(module, module.training) for module, _ in flags]
    try:
        for module, training in flags:
            module.training = training
        yield
    finally:
        for module, training in current:
            module.training = training


class ReplayedGraph:
    mode: ClassVar[BackwardMode] = "replay"
    survives_failed_backward = True

    def __init__(self, call: ForwardCall, rng: _RandomAndAutocast, flags: list[tuple[nn.Module, bool]],
                 parameter_versions: list[tuple[weakref.ref, int]], recorded: dict[str, torch.Tensor]):
        self._call: ForwardCall | None = call
        self._rng = rng
        self._flags = flags
        self._parameter_versions = parameter_versions
        self._recorded = recorded

    @classmethod
    def record(cls, run: Callable[[ForwardCall], dict[str, torch.Tensor]], call: ForwardCall,
               modules: Iterable[nn.Module], parameters: Iterable[torch.Tensor]) -> tuple["ReplayedGraph", dict]:
        rng = _RandomAndAutocast.capture(call.input_ids.device)
        flags = [(module, module.training) for module in modules]
        versions = [(weakref.ref(p), p._version) for p in parameters]
        with torch.no_grad():
            values = run(call)
        # What the forward produced, for the importance weight of a stale replay and
        # the top-k ids a replay gathers at (these alias the managed outputs: no copy).
        recorded = {name: values[name].detach() for name in ("logprobs", "topk", "topk_ids") if name in values}
        return cls(call.copied(), rng, flags, versions, recorded), values

    @property
    def saved_bytes(self) -> int:
        if self._call is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self._call.tensors())

    @property
    def recorded_outputs(self) -> dict[str, torch.Tensor]:
        """The forward's own logprobs / top-k values and top-k ids."""
        return self._recorded

    def _check_parameters_unchanged(self, read_at_current: frozenset[int]) -> None:
        """Raise PyTorch's in-place error if a parameter the replay reads changed since the forward."""
        for reference, version in self._parameter_versions:
            param = reference()
            if param is not None and id(param) not in read_at_current and param._version != version:
                raise inplace_error(f"{param.dtype} parameter", tuple(param.shape), version, param._version)

    def differentiate(self, inputs: Sequence[torch.Tensor], cotangents_for: CotangentsFor, *, keep_graph: bool,
                      rerun: Rerun) -> Gradients:
        assert self._call is not None, "differentiating a released graph"
        self._check_parameters_unchanged(rerun.current_parameter_ids)
        with self._rng.restored(), _training_flags(self._flags):
            outputs = rerun.run(self._call, self._recorded.get("topk_ids"))
        # The replayed graph is this call's alone: nothing to keep for a later backward.
        return gradients(outputs, cotangents_for(outputs), inputs, keep_graph=False)

    def release(self) -> None:
        self._call = None
        self._recorded = {}
        self._flags = []
        self._parameter_versions = []
