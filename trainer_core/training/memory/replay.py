"""Replayed backward state: keep what the forward saw, and run it again in backward.

What is kept: private copies of the inputs (the caller may refill its batch
buffers after the forward; an offloaded graph's copies go where its saved
tensors went), the CPU/CUDA RNG state (dropout draws the same masks), the
autocast state, every module's attributes and buffers as the forward started
(`module_state.py`: the train/eval flag, a buffer dynamic RoPE recomputes, the
active adapter), the top-k ids the forward chose, the forward's logprobs and
top-k values (for the importance weight of a stale replay), and the version
counter of every parameter — a parameter changed in place since the forward
raises PyTorch's "modified by an inplace operation" error instead of being
replayed at values the forward never saw.

The replay runs with grad enabled whatever the caller's grad mode (backward
under `torch.no_grad()` is still a backward). The caller's RNG and module
state are restored after it. A replay at the weights the forward ran at must
reproduce the forward's outputs bit for bit; one that does not — something it
reads changed in a way nothing here restores — raises instead of
differentiating another function.

The same record serves a graph retained or offloaded under the importance
policy: made before its forward (`ForwardStart`) and completed after
(`ReplayedGraph.of`), it is what the graph becomes once it is stale.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..outputs import RECORDED, ForwardCall
from .base import (
    BackwardStateError,
    CotangentsFor,
    ForwardRecording,
    Gradients,
    Rerun,
    differentiable_outputs,
    gradients,
    inplace_error,
)
from .costs import Evidence, OffloadTarget, PlanInputs
from .module_state import ModuleState
from .offload import OffloadHooks


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


@dataclass
class ForwardStart:
    """What a forward starts from besides its inputs and weights; taken right before it runs."""

    rng: _RandomAndAutocast
    modules: ModuleState
    parameter_versions: list[tuple[weakref.ref, int]]

    @classmethod
    def capture(
        cls, device: torch.device, modules: Iterable[nn.Module], parameters: Iterable[torch.Tensor]
    ) -> "ForwardStart":
        return cls(
            _RandomAndAutocast.capture(device),
            ModuleState.capture(modules),
            [(weakref.ref(p), p._version) for p in parameters],
        )

    @contextlib.contextmanager
    def restored(self):
        with self.rng.restored(), self.modules.restored():
            yield

    def replay(
        self, call: ForwardCall, values: Mapping[str, torch.Tensor], stash: OffloadHooks | None = None
    ) -> "ReplayedGraph":
        """The replay of the forward that ran from here and gave `values` (see `ReplayedGraph.of`)."""
        return ReplayedGraph.of(call, self, values, stash)


_TENSOR_FIELDS = ("input_ids", "attention_mask", "position_ids", "targets")


class _KeptInputs:
    """Private copies of a call's input tensors: on the device, or moved out through offload hooks of their own."""

    def __init__(self, call: ForwardCall, stash: OffloadHooks | None):
        self._stash = stash
        if stash is None:
            self._call, self._packed = call.copied(), {}
        else:
            tensors = {name: getattr(call, name) for name in _TENSOR_FIELDS if getattr(call, name) is not None}
            try:
                self._packed = {name: stash.move_out(tensor.detach()) for name, tensor in tensors.items()}
            except BaseException:
                stash.release()
                raise
            self._call = dataclasses.replace(call, **{name: None for name in tensors})
        nbytes = sum(t.numel() * t.element_size() for t in call.tensors())
        # Host memory is device memory on a CPU-only machine.
        moved_off = stash is not None and (stash.target == "disk" or call.input_ids.is_cuda)
        self.saved_bytes = 0 if moved_off else nbytes

    def call(self) -> ForwardCall:
        assert self._call is not None, "replaying a released graph"
        if not self._packed:
            return self._call
        stash = self._stash
        assert stash is not None  # inputs are packed only through a stash (__init__)
        return dataclasses.replace(self._call, **{name: stash.unpack(p) for name, p in self._packed.items()})

    def release(self) -> None:
        self._call, self._packed, self.saved_bytes = None, {}, 0
        if self._stash is not None:
            self._stash.release()


class ReplayMismatchError(BackwardStateError):
    """A replay at the forward's weights computed something else than the forward did."""


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _check_reproduced(outputs: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    """Raise unless every expected output came out of the replay bit for bit."""
    for name, recorded in expected.items():
        replayed = outputs[name]
        comparable = replayed.shape == recorded.shape and replayed.dtype == recorded.dtype
        if comparable and torch.equal(_bits(replayed), _bits(recorded)):
            continue
        if not comparable:
            detail = (
                f"{tuple(replayed.shape)}/{replayed.dtype} where the forward gave "
                f"{tuple(recorded.shape)}/{recorded.dtype}"
            )
        else:
            with torch.no_grad():
                differs = (_bits(replayed) != _bits(recorded)).view(-1, replayed.element_size()).any(-1)
                difference = (replayed.double() - recorded.double()).abs().max()
                detail = f"{int(differs.sum())} of {recorded.numel()} values differ, max |difference| {float(difference):.3g}"
        raise ReplayMismatchError(
            f"the replay did not reproduce the forward's {name} bitwise ({detail}): something the model reads changed "
            "since the forward in a way a replay cannot restore (a buffer or an object changed in place); nothing was "
            "accumulated — run the forward again, or record it with mode='retain' or 'offload'"
        )


class ReplayedGraph:
    """Keeps the inputs and what the forward started from, and runs the forward again in backward."""

    mode: ClassVar[str] = "replay"
    replays: ClassVar[bool] = True
    is_default: ClassVar[bool] = False
    planned: ClassVar[bool] = True
    exploration_rank: ClassVar[int | None] = 1
    exploration_reason: ClassVar[str] = "replay keeps only the inputs and measures the bytes"
    cheaper_reason: ClassVar[str] = "replay is cheaper"
    cost_key: ClassVar[str] = "replay_s"
    tie_rank: ClassVar[int] = 0
    last_resort: ClassVar[bool] = False
    # Its rerun's graph is private to one backward: a failed backward leaves the record as it was.
    freed_by_backward = False

    def __init__(self, inputs: _KeptInputs, start: ForwardStart, recorded: dict[str, torch.Tensor]):
        self._inputs: _KeptInputs | None = inputs
        self._start = start
        self._recorded = recorded

    @classmethod
    def record(cls, forward: ForwardRecording) -> tuple["ReplayedGraph", dict]:
        call = forward.call
        start = ForwardStart.capture(call.input_ids.device, forward.modules(), forward.parameters())
        with torch.no_grad():
            values = forward.run(call)
        return cls.of(call, start, values), values

    def forward_evidence(self, forward_s: float) -> Evidence:
        return Evidence()  # a forward without grad saves nothing: its replay in backward is the evidence

    def backward_evidence(self) -> Evidence:
        return Evidence()

    def stale_replay_stash(self):
        return None  # it is a replay already

    # -- the planner's cost model --

    @classmethod
    def available(cls, inputs: PlanInputs) -> bool:
        return inputs.fits(inputs.input_bytes)

    @classmethod
    def unavailable_reason(cls, inputs: PlanInputs) -> str:
        return "replay's input copies do not fit " + ("the budget" if inputs.exploring else "it either")

    @classmethod
    def placement(cls, inputs: PlanInputs) -> OffloadTarget | None:
        return None

    @classmethod
    def planned_bytes(cls, inputs: PlanInputs) -> float:
        return inputs.input_bytes

    @classmethod
    def extra_seconds(cls, inputs: PlanInputs) -> float:
        # One more forward; with no forward timed yet it cannot be priced.
        per_token = inputs.forward_s_per_token
        return per_token * inputs.shape.padded_tokens if per_token else math.inf

    @classmethod
    def of(
        cls,
        call: ForwardCall,
        start: ForwardStart,
        values: Mapping[str, torch.Tensor],
        stash: OffloadHooks | None = None,
    ) -> "ReplayedGraph":
        """The replay of a forward that ran from `start` and gave `values`, in any mode; `stash` moves the input
        copies off the device (an offloaded graph's, so that they too keep nothing resident)."""
        # What the forward produced, for the importance weight of a stale replay and
        # the top-k ids a replay gathers at (these alias the managed outputs: no copy).
        recorded = {name: values[name].detach() for name in RECORDED if name in values}
        return cls(_KeptInputs(call, stash), start, recorded)

    @property
    def saved_bytes(self) -> int:
        if self._inputs is None:
            return 0
        return self._inputs.saved_bytes + self._start.modules.held_bytes()

    @property
    def recorded_outputs(self) -> dict[str, torch.Tensor]:
        """The forward's own logprobs / top-k values and top-k ids."""
        return self._recorded

    def _check_parameters_unchanged(self, read_at_current: frozenset[int]) -> None:
        """Raise PyTorch's in-place error if a parameter the replay reads changed since the forward."""
        for reference, version in self._start.parameter_versions:
            param = reference()
            if param is not None and id(param) not in read_at_current and param._version != version:
                raise inplace_error(f"{param.dtype} parameter", tuple(param.shape), version, param._version)

    def differentiate(
        self, inputs: Sequence[torch.Tensor], cotangents_for: CotangentsFor, *, keep_graph: bool, rerun: Rerun
    ) -> Gradients:
        assert self._inputs is not None, "differentiating a released graph"
        self._check_parameters_unchanged(rerun.current_parameter_ids)
        call = self._inputs.call()
        # Grad on whatever the caller's mode: the outputs must lead back to the weights.
        with self._start.restored(), torch.enable_grad():
            outputs = rerun.run(call, self._recorded.get("topk_ids"))
        if rerun.expected is not None:
            _check_reproduced(outputs, rerun.expected)
        cotangents = cotangents_for(outputs)
        # The replayed graph is this call's alone: nothing to keep for a later backward.
        return gradients(outputs, cotangents, differentiable_outputs(outputs, cotangents), inputs, keep_graph=False)

    def release(self) -> None:
        if self._inputs is not None:
            self._inputs.release()
        self._inputs = None
        self._recorded = {}
        self._start.modules.clear()
        self._start.parameter_versions = []
