"""Versioned forward graphs and the managed outputs that lead back to them.

A forward returns its outputs as leaf tensors the trainer owns (the caller's
loss graph ends at them) and keeps a `GraphRecord`: the versions it ran at,
the weights it used, and its backward state — the autograd graph itself
(retained or offloaded) or what a replay needs. When every managed output of a
forward has been dropped, its record is released and the graph freed.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from .memory.offload import OffloadHooks
from .memory.planner import BackwardMode
from .memory.replay import ReplayState
from .versions import Version

GRAPH_ATTRIBUTE = "_rankflow_output"


@dataclass
class ForwardCall:
    """What a forward was asked for; enough to run it again."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    targets: torch.Tensor | None
    outputs: tuple[str, ...]
    top_k: int

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum()) if self.attention_mask is not None else self.input_ids.numel()


@dataclass
class GraphRecord:
    graph_id: int
    mode: BackwardMode
    versions: dict[str, Version]
    weights: dict[str, dict[str, torch.Tensor]]
    """Per checkpoint, the parameter tensors the forward used (empty once released)."""
    call: ForwardCall | None
    internal: dict[str, torch.Tensor] | None = None
    replay: ReplayState | None = None
    offload: OffloadHooks | None = None
    recorded_logprobs: torch.Tensor | None = None
    saved_bytes: int = 0
    """Saved-tensor bytes this graph keeps resident on the device."""
    live_outputs: int = 0
    consumed: bool = False
    holds_weights: bool = True

    def release(self) -> None:
        self.internal = None
        self.replay = None
        self.call = None
        self.weights = {}
        self.saved_bytes = 0
        if self.offload is not None:
            self.offload.release()
            self.offload = None


@dataclass
class ManagedOutputs:
    """The outputs of one forward; tensors are owned by the trainer."""

    graph_id: int
    versions: dict[str, Version]
    logprobs: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    heads: dict[str, torch.Tensor] = field(default_factory=dict)


def make_leaf(tensor: torch.Tensor, graph_id: int, name: str) -> torch.Tensor:
    leaf = tensor.detach().requires_grad_(True)
    setattr(leaf, GRAPH_ATTRIBUTE, (graph_id, name))
    return leaf


def find_managed_leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """The managed outputs the loss depends on, found by walking its autograd graph."""
    if loss.grad_fn is None:
        tag = getattr(loss, GRAPH_ATTRIBUTE, None)
        return [loss] if tag is not None else []
    found, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None and getattr(variable, GRAPH_ATTRIBUTE, None) is not None:
            found.append(variable)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


class GraphTable:
    """Live graph records, released when their last managed output is dropped."""

    def __init__(self) -> None:
        self._records: dict[int, GraphRecord] = {}
        self._next_id = 0

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def add(self, record: GraphRecord, leaves: list[torch.Tensor]) -> None:
        record.live_outputs = len(leaves)
        self._records[record.graph_id] = record
        for leaf in leaves:
            weakref.finalize(leaf, self._output_dropped, record.graph_id)

    def _output_dropped(self, graph_id: int) -> None:
        record = self._records.get(graph_id)
        if record is None:
            return
        record.live_outputs -= 1
        if record.live_outputs <= 0:
            record.release()
            del self._records[graph_id]

    def get(self, graph_id: int) -> GraphRecord | None:
        return self._records.get(graph_id)

    def live(self) -> list[GraphRecord]:
        return list(self._records.values())

    def resident_saved_bytes(self) -> int:
        return sum(r.saved_bytes for r in self._records.values())
