"""Retained backward state: autograd's own graph, saved tensors left where autograd put them.

No saved-tensor hooks: a pack hook that returns the tensor itself makes, for
every op that saves its own output (softmax, rsqrt, exp), a reference cycle
through C++ that the garbage collector cannot see — the whole graph leaked —
and hooks switch off autograd's version check of saved tensors, so an input
buffer or a parameter changed in place between forward and backward would be
differentiated silently wrong. Without hooks, autograd frees the graph when the
outputs go and raises its own "modified by an inplace operation" error.

The saved bytes are counted after the forward by walking the graph's nodes and
their `_saved_*` tensors (distinct storages, parameters excluded): what is
actually saved, padding included. Under activation checkpointing
(`training/activation_checkpointing.py`) a checkpointed layer's nodes hold
placeholders, skipped unread (reading one would recompute the layer), and the
layer's output node names the input storages the layer keeps instead.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import ClassVar, cast

import torch
from torch.utils.checkpoint import _Holder

from .base import CotangentsFor, ForwardRecording, Gradients, Outputs, Rerun, differentiable_outputs, gradients
from .costs import Evidence, OffloadTarget, PlanInputs

CHECKPOINTED_INPUTS = "rankflow.checkpointed_inputs"
"""Key in an autograd node's metadata: the (data_ptr, nbytes) storages a checkpointed layer keeps as its inputs."""


@functools.cache
def _saved_attributes(node_type: type) -> tuple[str, ...]:
    """The names under which nodes of this type expose their saved tensors (a pure function of the type)."""
    names = [name for name in dir(node_type) if name.startswith("_saved_")]
    if hasattr(node_type, "saved_tensors"):  # custom autograd.Function nodes
        names.append("saved_tensors")
    return tuple(names)


def saved_tensor_bytes(
    outputs: Outputs, excluded_storages: set[int], excluded_impls: frozenset[int] = frozenset()
) -> int:
    """Bytes of the distinct storages the graph behind `outputs` saved, parameters' storages excluded (by data_ptr,
    or by StorageImpl id for weights whose data_ptr moves: a sharded engine's gathered parameters)."""
    counted: dict[int, int] = {}
    seen: set = set()
    stack: list[torch.autograd.graph.Node | None] = [t.grad_fn for t in outputs.values() if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for key, nbytes in _metadata(node).get(CHECKPOINTED_INPUTS, ()):
            if key not in excluded_storages:
                counted[key] = nbytes
        for attribute in _saved_attributes(type(node)):
            if _checkpoint_placeholder(node, attribute):
                continue
            try:
                value = getattr(node, attribute)
            except RuntimeError:  # a saved variable that cannot be unpacked holds nothing we could count
                continue
            for tensor in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    key = storage.data_ptr()
                    if key not in excluded_storages and storage._cdata not in excluded_impls:
                        counted[key] = storage.nbytes()
        stack.extend(next_node for next_node, _ in node.next_functions)
    return sum(counted.values())


def _metadata(node: torch.autograd.graph.Node) -> dict:
    return cast("dict", node.metadata)  # a property at run time; torch declares it a method


def _checkpoint_placeholder(node: torch.autograd.graph.Node, attribute: str) -> bool:
    """Whether a saved tensor is activation checkpointing's placeholder: packed by checkpoint's hook, read unpacked."""
    try:
        raw = getattr(node, "_raw" + attribute, None) if attribute.startswith("_saved_") else None
    except RuntimeError:  # released: holds nothing, and reading it unpacks nothing either
        return False
    for saved in raw if isinstance(raw, (tuple, list)) else (raw,):
        # A SavedTensor's `data` is what the pack hook returned, read without the unpack hook (not in torch's stubs).
        if isinstance(getattr(saved, "data", None), _Holder):
            return True
    return False


class RetainedGraph:
    """Autograd's own graph, saved tensors left where autograd put them: the default."""

    mode: ClassVar[str] = "retain"
    replays: ClassVar[bool] = False
    is_default: ClassVar[bool] = True
    planned: ClassVar[bool] = True
    exploration_rank: ClassVar[int | None] = None
    no_budget_reason: ClassVar[str] = "no budget"
    fits_reason: ClassVar[str] = "fits the budget"

    def __init__(self, outputs: dict[str, torch.Tensor], saved_bytes: int):
        self._outputs: dict[str, torch.Tensor] | None = outputs
        self._saved_bytes = saved_bytes
        self.freed_by_backward = False

    @classmethod
    def record(cls, forward: ForwardRecording) -> tuple["RetainedGraph", dict]:
        values = forward.timed()
        return cls(values, saved_tensor_bytes(values, forward.parameter_storages(), forward.weight_impls())), values

    def forward_evidence(self, forward_s: float) -> Evidence:
        return Evidence(forward_s=forward_s, saved_bytes=self.saved_bytes)

    def backward_evidence(self) -> Evidence:
        return Evidence()

    def stale_replay_stash(self):
        return None  # a retained graph's replay keeps its input copies on the device, as the graph keeps its tensors

    # -- the planner's cost model --

    @classmethod
    def available(cls, inputs: PlanInputs) -> bool:
        return True

    @classmethod
    def budgeted_bytes(cls, inputs: PlanInputs) -> float:
        """What the graph is checked against the budget with: the estimate plus its headroom."""
        assert inputs.estimate is not None
        return inputs.estimate * (1 + inputs.estimate_headroom) + inputs.stale_input_bytes

    @classmethod
    def planned_bytes(cls, inputs: PlanInputs) -> float:
        assert inputs.estimate is not None
        return inputs.estimate + inputs.stale_input_bytes

    @classmethod
    def extra_seconds(cls, inputs: PlanInputs) -> float:
        return 0.0

    @classmethod
    def placement(cls, inputs: PlanInputs) -> OffloadTarget | None:
        """Where an offloading mode moves its tensors (None: nowhere)."""
        return None

    @property
    def saved_bytes(self) -> int:
        return self._saved_bytes if self._outputs is not None else 0

    @property
    def outputs(self) -> Outputs:
        assert self._outputs is not None, "differentiating a released graph"
        return self._outputs

    def differentiate(
        self, inputs: Sequence[torch.Tensor], cotangents_for: CotangentsFor, *, keep_graph: bool, rerun: Rerun
    ) -> Gradients:
        cotangents = cotangents_for(self.outputs)
        names = differentiable_outputs(self.outputs, cotangents)
        # From here autograd frees saved tensors as it goes unless kept, whether or not it gets to the end.
        self.freed_by_backward = self.freed_by_backward or (not keep_graph and bool(names) and bool(inputs))
        return gradients(self.outputs, cotangents, names, inputs, keep_graph)

    def release(self) -> None:
        self._outputs = None
