"""Versioned forward graphs, the managed outputs that lead back to them, and what a loss depends on.

A forward returns its outputs as leaf tensors the trainer owns (the caller's
loss graph ends at them) and keeps a `Graph`: the versions it ran at, the
weights it holds for its backward, and its backward state — an instance of
one of `memory.BACKWARD_STATES`. Under the importance policy a graph that
does not replay also holds a `ReplayedGraph` for later
(`stale_replay`): once stale, it becomes that. When every managed output of a
forward has been dropped, the graph is released; a graph that was backwarded
(without retain_graph, or by a backward that failed after autograd freed part
of it) or can never be differentiated again (past the staleness bound, or its
checkpoint replaced) is released at once and keeps only what its error message
needs.

Every output is tagged with its trainer's table token, so a loss over two
trainers' outputs is refused instead of routed to the wrong graphs.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..parallel import WeightSnapshot, local_tensor
from .memory.base import BackwardMode, BackwardState
from .outputs import FIELDS, HEAD_PREFIX
from .versions import Version

GRAPH_ATTRIBUTE = "_rankflow_output"

GraphStatus = Literal["live", "consumed", "expired"]


class GraphConsumedError(RuntimeError):
    """A forward's graph was already used by a backward without retain_graph=True."""


@dataclass(eq=False)
class Graph:
    graph_id: int
    versions: Mapping[str, Version]
    weights: dict[str, Mapping[str, torch.Tensor]]
    """Per checkpoint, the parameter tensors the forward used, held for the backward (empty when not needed)."""
    state: BackwardState | None
    stale_replay: BackwardState | None = None
    """What a replay of this forward needs, kept under the importance policy by a retained or offloaded graph."""
    live_outputs: int = 0
    status: GraphStatus = "live"
    consumed_because: str = ""
    """Why a consumed graph cannot be differentiated again, when not because a backward succeeded."""
    snapshots: dict[str, WeightSnapshot] = field(default_factory=dict)
    """Per sharded checkpoint that stepped since the forward, its shards at the forward's revision (this rank's
    1/W): swapped in for the backward, since a sharded engine gathers the weights again there (`Parallelism.snapshot`)."""
    mode: BackwardMode = field(init=False)

    def __post_init__(self) -> None:
        assert self.state is not None  # a graph is built around its state; only release() clears it
        self.mode = self.state.mode

    @property
    def saved_bytes(self) -> int:
        return sum(s.saved_bytes for s in (self.state, self.stale_replay) if s is not None)

    def holds_weights_of(self, checkpoint: str, version: Version) -> bool:
        return self.state is not None and checkpoint in self.weights and self.versions.get(checkpoint) == version

    def replay_from_now_on(self) -> None:
        """Drop the saved tensors and become the replay kept for this (a stale graph under the importance policy)."""
        assert self.stale_replay is not None and self.state is not None
        self.state.release()
        self.state, self.stale_replay = self.stale_replay, None
        self.mode = self.state.mode

    def release(self, status: GraphStatus, because: str = "") -> None:
        for state in (self.state, self.stale_replay):
            if state is not None:
                state.release()
        self.state, self.stale_replay, self.weights, self.status = None, None, {}, status
        self.snapshots = {}
        self.consumed_because = because


@dataclass
class ManagedOutputs:
    """The outputs of one forward; tensors are owned by the trainer."""

    graph_id: int | None
    """None for a forward run under torch.no_grad(): its outputs have no graph."""
    versions: dict[str, Version]
    logprobs: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    heads: dict[str, torch.Tensor] = field(default_factory=dict)

    def fields(self) -> dict[str, torch.Tensor]:
        """The outputs present, by field name (`head:NAME` for heads), in `outputs.FIELDS` order."""
        present = {name: getattr(self, name) for name in FIELDS if getattr(self, name) is not None}
        present.update({HEAD_PREFIX + name: tensor for name, tensor in self.heads.items()})
        return present

    def get_field(self, name: str) -> torch.Tensor | None:
        """The output of field `name` (`head:NAME` for a head)."""
        if name.startswith(HEAD_PREFIX):
            return self.heads[name.removeprefix(HEAD_PREFIX)]
        return getattr(self, name)

    def set_field(self, name: str, value: torch.Tensor) -> None:
        """Set the output of field `name` (`head:NAME` for a head)."""
        if name.startswith(HEAD_PREFIX):
            self.heads[name.removeprefix(HEAD_PREFIX)] = value
        elif name in FIELDS:
            setattr(self, name, value)
        else:
            raise KeyError(f"unknown output field {name!r}; fields are {FIELDS} and {HEAD_PREFIX}NAME")


def make_leaf(tensor: torch.Tensor, token: str, graph_id: int, name: str) -> torch.Tensor:
    leaf = tensor.detach().requires_grad_(True)
    setattr(leaf, GRAPH_ATTRIBUTE, (token, graph_id, name))
    return leaf


@dataclass
class LossLeaves:
    """The leaves a loss depends on, sorted by who owns them."""

    managed: list[torch.Tensor] = field(default_factory=list)
    """Managed outputs of this trainer."""
    foreign: list[torch.Tensor] = field(default_factory=list)
    """Managed outputs of another trainer."""
    others: list[torch.Tensor] = field(default_factory=list)
    """Any other tensor that requires grad (a checkpoint's parameter used directly, or something unowned)."""


def loss_leaves(loss: torch.Tensor, token: str) -> LossLeaves:
    """Walk the loss's autograd graph down to its leaves."""
    found = LossLeaves()

    def sort(variable: torch.Tensor) -> None:
        tag = getattr(variable, GRAPH_ATTRIBUTE, None)
        if tag is None:
            found.others.append(variable)
        elif tag[0] == token:
            found.managed.append(variable)
        else:
            found.foreign.append(variable)

    if loss.grad_fn is None:
        if loss.requires_grad:
            sort(loss)
        return found
    seen: set = set()
    stack: list[torch.autograd.graph.Node | None] = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None:
            sort(variable)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def leaf_tag(leaf: torch.Tensor) -> tuple[int, str]:
    _, graph_id, name = getattr(leaf, GRAPH_ATTRIBUTE)
    return graph_id, name


class GraphTable:
    """Live graphs of one trainer, released when their last managed output is dropped."""

    def __init__(self) -> None:
        self._graphs: dict[int, Graph] = {}
        self._next_id = 0
        self.token = uuid.uuid4().hex
        """Tags this trainer's outputs; graph ids alone restart at 1 in every trainer."""

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def add(self, graph: Graph, leaves: list[torch.Tensor]) -> None:
        graph.live_outputs = len(leaves)
        self._graphs[graph.graph_id] = graph
        for leaf in leaves:
            weakref.finalize(leaf, self._output_dropped, graph.graph_id)

    def _output_dropped(self, graph_id: int) -> None:
        graph = self._graphs.get(graph_id)
        if graph is None:
            return
        graph.live_outputs -= 1
        if graph.live_outputs <= 0:
            graph.release("consumed")
            del self._graphs[graph_id]

    def get(self, graph_id: int) -> Graph | None:
        return self._graphs.get(graph_id)

    def _all(self) -> tuple[Graph, ...]:
        # A garbage collection while we iterate may drop a graph's last output, and its finalizer removes the
        # graph from the table: iterate over a copy, taken in one step.
        return tuple(self._graphs.values())

    def live(self) -> list[Graph]:
        return [g for g in self._all() if g.status == "live"]

    def resident_saved_bytes(self) -> int:
        return sum(g.saved_bytes for g in self._all())

    def held_weight_bytes(self, live_storages: set[int]) -> int:
        """Bytes of the weight snapshots graphs hold: tensors a step handed over, no longer any checkpoint's."""
        held: dict[int, int] = {}
        for graph in self._all():
            for tensors in graph.weights.values():
                for tensor in tensors.values():
                    storage = local_tensor(tensor).untyped_storage()
                    if storage.data_ptr() not in live_storages:
                        held[storage.data_ptr()] = storage.nbytes()
        # A sharded checkpoint's revision is a snapshot of this rank's shards, shared by the graphs that hold it.
        snapshots = {id(s): s.nbytes for graph in self._all() for s in graph.snapshots.values()}
        return sum(held.values()) + sum(snapshots.values())
