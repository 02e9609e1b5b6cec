"""The trainer API: forward now, compute a loss later, step in between, still get correct gradients.

    trainer = Trainer(model)
    trainer.add_base_checkpoint()                   # or add_lora_checkpoint / add_module_checkpoint
    out = trainer.forward(input_ids, attention_mask, outputs=("logprobs",), mode="replay")
    loss = my_loss(out.logprobs, …)                 # any graph that ends at managed outputs
    trainer.backward(loss)                          # cotangents → each forward's graph → staged → committed
    trainer.step()                                  # AdamW per checkpoint, versions advance

Gradients are summed over ranks at `step`; normalise the loss accordingly. How
they are summed is the trainer's `gradient_reduction` (`gradient_reduction.py`):
an all-reduce by default, a fold in logical-rank order under `trainer_core.ranks`.
With several LoRA adapters registered, `forward(..., checkpoint="name")` runs
the model with that adapter active (a replay activates it again), and the
graph depends on that adapter only (besides the base and the heads).
Registration lives in `registry.py`, the optimizer step in `stepping.py`,
backward state in `memory/`, the staleness rule in `staleness.py`.

How the model is spread over the processes is the trainer's `parallelism`
(`trainer_core.parallel`), which the trainer asks and never names:
`Replicated(model)` by default, or a sharded one such as
`Trainer(model, parallelism=FullyShard.wrap(model, mesh))`. Parameters, AdamW
moments and gradients are then this rank's shards; the FP32 sharded parameters
are the masters under a bf16 mixed-precision policy; forward and backward are
collectives (the engine gathers and reduces inside them), so every rank runs
the same forwards and backwards; gradients are summed by the engine inside
backward (`ShardedSum`), or, under
the logical-DP facade with the deterministic reduction, folded in logical order
(`trainer_core.parallel.fsdp.gradients`). LoRA adapters over a sharded frozen
base are injected before sharding (`lora_injection.inject_lora`) and then
registered by name with `add_lora_checkpoint`; their stale graphs snapshot the
adapter's shards only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from ..parallel import Parallelism, Replicated, local_tensor
from .checkpoints import Checkpoint, StepReport
from .gradient_reduction import GradientReduction, RankSum, ShardedSum
from .graphs import (
    Graph,
    GraphConsumedError,
    GraphTable,
    LossLeaves,
    ManagedOutputs,
    leaf_tag,
    loss_leaves,
    make_leaf,
)
from .memory import (
    BACKWARD_STATES,
    BackwardMode,
    BackwardStateError,
    Evidence,
    ForwardRecording,
    ForwardStart,
    MemoryPlanner,
    Rerun,
)
from .memory.base import ReplayingState
from .memory.estimates import GraphShape
from .memory.offload import OffloadTarget
from .memory.retained import saved_tensor_bytes
from .memory.timing import Stopwatch
from .outputs import FIELD_OF, IMPORTANCE_WEIGHTED, ForwardCall, compute_outputs, is_leaf_field
from .registry import CheckpointRegistry
from .staleness import StaleGraphError, StalenessPolicy, importance_weights
from .stepping import step_checkpoints
from .transaction import NonFinitePolicy, StagedGradients


@dataclass(frozen=True)
class BackwardReport:
    num_graphs: int
    ages: dict[int, dict[str, int]]
    """Per graph id, its age in optimizer steps per checkpoint."""
    num_gradients: int


class Trainer(CheckpointRegistry):
    def __init__(
        self,
        model: nn.Module,
        *,
        staleness: StalenessPolicy | None = None,
        planner: MemoryPlanner | None = None,
        offload_target: OffloadTarget | None = None,
        nonfinite: NonFinitePolicy = "error",
        vocab_size: int | None = None,
        parallelism: Parallelism | None = None,
    ):
        """`vocab_size`: the true vocabulary when the model's embedding rows were padded past it (outputs cover
        the true vocabulary only); None when they were not. `parallelism`: how the model is spread over the
        processes (`trainer_core.parallel`; None: `Replicated(model)`, the whole model on every rank); register
        checkpoints after wrapping the model (a sharded one's checkpoints hold the sharded parameters)."""
        parallelism = parallelism or Replicated(model)
        if parallelism.model is not model:
            raise ValueError(
                "parallelism= describes another model; pass the parallelism built around this one "
                "(e.g. FullyShard.wrap(model, mesh))"
            )
        super().__init__(model, parallelism)
        # Stable for the model's life: the whole weights a sharded engine gathers, whose data_ptr moves.
        self._weight_impls = parallelism.weight_storages()
        self.vocab_size = vocab_size
        self.staleness = staleness or StalenessPolicy()
        self.planner = planner or MemoryPlanner()
        device = next(model.parameters()).device
        # On a CPU-only machine host memory *is* device memory: offload to disk.
        self.offload_target: OffloadTarget = offload_target or ("host" if device.type == "cuda" else "disk")
        if nonfinite not in ("error", "skip"):
            raise ValueError(
                f"nonfinite={nonfinite!r}; choose 'error' (refuse non-finite gradients at backward) "
                "or 'skip' (accept them; the step then skips the update on every rank)"
            )
        self.nonfinite: NonFinitePolicy = nonfinite
        self.graphs = GraphTable()
        self.peak_saved_bytes = 0
        """The highest `resident_bytes()` seen right after a forward or a step."""
        # An engine that sums its gradients inside backward leaves the step only what it does not hold (heads).
        self._gradient_reduction: GradientReduction = ShardedSum() if parallelism.reduces_in_backward else RankSum()

    @property
    def gradient_reduction(self) -> GradientReduction:
        """How gradients are agreed on at backward and summed over processes at step (replaced by trainer_core.ranks)."""
        return self._gradient_reduction

    @gradient_reduction.setter
    def gradient_reduction(self, reduction: GradientReduction) -> None:
        self.parallelism.check_reduction(reduction)
        self._gradient_reduction = reduction

    # -- forward -----------------------------------------------------------------

    def _current_versions(self) -> dict:
        return {name: c.version for name, c in self.checkpoints.items()}

    def _versions_for(self, adapter: str | None) -> dict:
        """The versions a forward runs at: every checkpoint but the LoRA adapters not selected."""
        return {name: c.version for name, c in self.checkpoints.items() if c.kind != "lora" or name == adapter}

    def resident_bytes(self) -> int:
        """What live graphs keep on the device: their saved tensors, and weight snapshots no checkpoint holds now."""
        return self.graphs.resident_saved_bytes() + self.graphs.held_weight_bytes(self._parameter_storages())

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        targets: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        outputs: Iterable[str] = ("logprobs",),
        top_k: int = 0,
        mode: BackwardMode | None = None,
        checkpoint: str | None = None,
    ) -> ManagedOutputs:
        """Run the model and return managed outputs; `mode` None lets the planner choose.

        Without `targets`, `logprobs[:, t]` is the log-probability of `input_ids[:, t+1]`.
        `checkpoint` names the LoRA adapter to run with (required when several are registered).
        Under `torch.no_grad()` the outputs are plain tensors with no graph (nothing is kept).
        """
        call = ForwardCall(
            input_ids, attention_mask, position_ids, targets, tuple(outputs), top_k, self.selected_adapter(checkpoint)
        )
        if mode is not None and mode not in BACKWARD_STATES:
            raise ValueError(f"mode={mode!r}; choose one of {tuple(BACKWARD_STATES)} or None for the planner")
        versions = self._versions_for(call.adapter)
        if not torch.is_grad_enabled():
            self._begin_forward(None)
            with self._resharded_on_error():
                values = self._run(call)
            return self._managed(values, None, versions)
        self._expire_graphs()
        shape = _graph_shape(call)
        decision = None
        offload_target = self.offload_target
        if mode is None:
            decision = self.planner.choose(
                shape,
                self.resident_bytes(),
                input_bytes=call.nbytes,
                offload_target=self.offload_target,
                offload_frees=self.offload_target == "disk" or call.input_ids.is_cuda,
                stale_input_bytes=call.nbytes if self.staleness.records_stale_replays else 0,
            )
            mode, offload_target = decision.mode, decision.offload_target or offload_target
        self._begin_forward(mode)
        with self._resharded_on_error():
            state, values, stale_replay = self._record(BACKWARD_STATES[mode], call, shape, offload_target)
        weights: dict[str, Mapping[str, torch.Tensor]] = (
            {name: self.checkpoints[name].parameters() for name in versions} if self.staleness.keeps_weights() else {}
        )
        graph = Graph(self.graphs.new_id(), versions, weights, state, stale_replay)
        try:
            managed = self._managed(values, graph, versions)
        except BaseException:  # no output leads to the graph: nothing else would ever release it
            graph.release("consumed")
            raise
        resident = self.resident_bytes()
        self.peak_saved_bytes = max(self.peak_saved_bytes, resident)
        if decision is not None:
            self.planner.settle(decision, resident)
        return managed

    def _begin_forward(self, mode: BackwardMode | None) -> None:
        """Tell the gradient reduction a forward of `mode` (None: under no_grad) is about to run, before any
        collective of it (e.g. a sharded fold checks that every process's block runs the same kind of forward)."""
        begin = getattr(self.gradient_reduction, "begin_forward", None)
        if begin is not None:
            begin(mode)

    @contextlib.contextmanager
    def _resharded_on_error(self):
        """Whatever a forward raises, a sharded model is left as before it: the units the forward had gathered
        are resharded (left gathered, the next forward would skip its all-gather and run at their old values)."""
        try:
            yield
        except BaseException:
            self.parallelism.recover_after_failed_pass()
            raise

    def _run(self, call: ForwardCall, topk_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        self.activate_adapter(call.adapter)
        return compute_outputs(self.model, self.heads, call, topk_ids, vocab_size=self.vocab_size)

    def _record(self, cls, call: ForwardCall, shape: GraphShape, offload_target: OffloadTarget):
        """Run the forward as backward state `cls`: the state, its outputs, and (importance policy) what a replay
        of it needs once it is stale. While the planner measures, the state reports what the forward cost."""
        measuring = self.planner.measuring
        # A replay starts from the module state the forward ran with: the adapter already active.
        self.activate_adapter(call.adapter)
        start = None
        if self.staleness.records_stale_replays and not cls.replays:
            start = ForwardStart.capture(call.input_ids.device, self._modules(), self._all_parameters())
        recording = ForwardRecording(
            call,
            self._run,
            Stopwatch(call.input_ids.device, enabled=measuring),
            self._modules,
            self._all_parameters,
            self._parameter_storages,
            offload_target,
            measuring,
            lambda: self._weight_impls,
        )
        state, values = cls.record(recording)
        if measuring:
            self.planner.observe(shape, state.forward_evidence(recording.watch.seconds))
        if start is None:
            return state, values, None
        try:
            return state, values, start.replay(call, values, state.stale_replay_stash())
        except BaseException:
            state.release()
            raise

    def _modules(self) -> list[nn.Module]:
        return [m for root in (self.model, *self.heads.values()) for m in root.modules()]

    def _managed(self, values: dict[str, torch.Tensor], graph: Graph | None, versions: dict) -> ManagedOutputs:
        managed = ManagedOutputs(graph_id=None if graph is None else graph.graph_id, versions=versions)
        leaves = []
        for name, value in values.items():
            field = FIELD_OF.get(name, name)  # a head's output is `head:NAME` under both names
            if not is_leaf_field(field):  # the top-k ids: indices, not a leaf
                managed.set_field(field, value)
                continue
            leaf = value.detach() if graph is None else make_leaf(value, self.graphs.token, graph.graph_id, name)
            leaves.append(leaf)
            managed.set_field(field, leaf)
        if graph is not None:
            self.graphs.add(graph, leaves)
        return managed

    # -- backward ----------------------------------------------------------------

    def _sorted_leaves(self, loss: torch.Tensor) -> tuple[list[torch.Tensor], list[tuple[str, str, torch.Tensor]]]:
        """This trainer's managed outputs in the loss, and its checkpoints' parameters used directly; refuse the rest."""
        found: LossLeaves = loss_leaves(loss, self.graphs.token)
        if found.foreign:
            raise ValueError(
                "the loss depends on managed outputs of another Trainer; give each trainer a loss over its own outputs "
                "(policy.backward(policy_loss); critic.backward(critic_loss)) — nothing was accumulated"
            )
        owners = self.parameter_owners()
        direct, unowned = [], []
        for tensor in found.others:
            owner = owners.get(id(tensor))
            if owner is None:
                unowned.append(tensor)
            else:
                direct.append((*owner, tensor))
        if not found.managed and not direct:
            raise ValueError("the loss depends on no managed output; build it from the outputs of trainer.forward(...)")
        if unowned:
            shapes = ", ".join(f"{tuple(t.shape)}/{t.dtype}" for t in unowned[:4])
            raise ValueError(
                f"the loss depends on {len(unowned)} tensor(s) that require grad but no checkpoint owns ({shapes}); "
                "register their module with add_module_checkpoint, or detach them — nothing was accumulated"
            )
        return found.managed, direct

    def backward(
        self, loss: torch.Tensor, gradient: torch.Tensor | None = None, *, retain_graph: bool = False
    ) -> BackwardReport:
        """Push the loss's cotangents through every forward it depends on, as one transaction.

        As `loss.backward(gradient, retain_graph)`: `gradient` is required for a
        non-scalar loss, and `retain_graph=True` keeps the loss's graph and the
        forwards' graphs for another backward.
        """
        error: BaseException | None = None
        entered: list[Graph] = []
        try:
            begin = getattr(self.gradient_reduction, "begin_backward", None)
            if begin is not None:  # e.g. a sharded fold's turn opens before the engine reduces anything
                begin()
            graphs, staged, ages = self._stage(loss, gradient, retain_graph, entered)
            staged.validate(self.nonfinite)
            staged.build()
        except Exception as failure:  # noqa: BLE001 - every rank must hear of it before anyone raises
            error = failure
        error = self.gradient_reduction.agree_on_backward(error)
        if error is not None:
            # An exception inside autograd leaves a sharded engine's gathered units and partial gradients behind:
            # the next backward would add onto them (every rank heard of the error, so every rank recovers).
            self.parallelism.recover_after_failed_pass()
        self._settle(entered, error, retain_graph=retain_graph)
        if error is not None:
            raise error
        num_gradients = len(staged)
        staged.publish()
        return BackwardReport(len(graphs), ages, num_gradients)

    def _stage(self, loss: torch.Tensor, gradient: torch.Tensor | None, retain_graph: bool, entered: list[Graph]):
        """Every gradient the loss gives this trainer's checkpoints, staged; graphs differentiated go into `entered`."""
        managed, direct = self._sorted_leaves(loss)
        wrt = managed + [param for _, _, param in direct]
        cotangents = torch.autograd.grad(loss, wrt, grad_outputs=gradient, retain_graph=retain_graph, allow_unused=True)
        by_graph: dict[int, dict[str, torch.Tensor]] = {}
        used: dict[int, dict[str, torch.Tensor]] = {}  # the managed outputs themselves: what a replay must reproduce
        for leaf, cotangent in zip(managed, cotangents):
            if cotangent is not None:
                graph_id, name = leaf_tag(leaf)
                by_graph.setdefault(graph_id, {})[name] = cotangent
                used.setdefault(graph_id, {})[name] = leaf
        foreign = [c for c in cotangents if c is not None] + ([gradient] if gradient is not None else [])
        staged = StagedGradients(self.checkpoints, foreign)
        for (checkpoint, param, _), grad in zip(direct, cotangents[len(managed) :]):
            if grad is not None:
                staged.add(checkpoint, param, grad)
        graphs = [self._backwardable(graph_id) for graph_id in by_graph]
        # Saved tensors are freed as autograd goes unless kept. Keep them while a
        # retry is possible: retain_graph, a later graph of this backward that may
        # fail, or another rank that may. A lone graph on one rank frees them as
        # plain autograd does (a lower peak).
        keep_graph = (
            retain_graph or len(graphs) > 1 or (self.world_size > 1 and self.gradient_reduction.backward_is_collective)
        )
        ages: dict[int, dict[str, int]] = {}
        for graph in graphs:
            ages[graph.graph_id] = self.staleness.ages(graph.versions, self._current_versions())
            entered.append(graph)
            grads = self._differentiate(
                graph, by_graph[graph.graph_id], used[graph.graph_id], ages[graph.graph_id], keep_graph
            )
            for (checkpoint, param), grad in grads.items():
                staged.add(checkpoint, param, grad)
        return graphs, staged, ages

    def _backwardable(self, graph_id: int) -> Graph:
        graph = self.graphs.get(graph_id)
        if graph is None or graph.status == "consumed":
            raise GraphConsumedError(
                f"graph {graph_id} "
                + (
                    (graph.consumed_because if graph is not None else "")
                    or "was already used by a backward; pass retain_graph=True to backward it again"
                )
            )
        if graph.status == "expired":
            self.staleness.ages(graph.versions, self._current_versions())  # raises, naming checkpoint and age
            raise StaleGraphError(f"graph {graph_id} can no longer be differentiated; run the forward again")
        return graph

    def _settle(self, graphs: list[Graph], error: BaseException | None, *, retain_graph: bool) -> None:
        """Once every rank agreed, settle each graph from what autograd did to it: consumed by a backward that
        succeeded without retain_graph, or by one that failed after autograd had run through it freeing as it
        went (part of it is gone); live otherwise, for a retry."""
        for graph in graphs:
            if graph.state is None:
                continue
            if error is None and not retain_graph:
                graph.release("consumed")
            elif error is not None and graph.state.freed_by_backward:
                graph.release(
                    "consumed",
                    f"cannot be differentiated again: its backward failed ({type(error).__name__}: "
                    f"{error}) after autograd had freed part of it; run the forward again",
                )

    def _differentiate(
        self,
        graph: Graph,
        cotangents: dict[str, torch.Tensor],
        used: dict[str, torch.Tensor],
        ages: dict[str, int],
        keep_graph: bool,
    ) -> dict[tuple[str, str], torch.Tensor]:
        """One graph's gradients, per (checkpoint, parameter), at the weights the staleness policy says.

        `used`: the graph's managed outputs the loss depends on — a replay at the forward's weights must give
        them again bit for bit."""
        state = graph.state
        assert state is not None  # _backwardable gave a live graph, which holds its state
        at_current = {name for name, age in ages.items() if self.staleness.replays_at_current_weights(age)}
        # A retained or offloaded graph becomes its replay at the step that makes it stale (`_expire_graphs`).
        assert not at_current or state.replays, f"graph {graph.graph_id} is stale, not replayed"
        weights: dict[str, Mapping[str, torch.Tensor]] = {
            name: (graph.weights[name] if name in graph.weights and name not in at_current else c.parameters())
            for name, c in self.checkpoints.items()
            if name in graph.versions
        }
        keys = [(c, p) for c, tensors in weights.items() for p, t in tensors.items() if t.requires_grad]
        inputs = [weights[c][p] for c, p in keys]
        # Parameters whose in-place changes since the forward do not matter to a replay: read at their
        # current values on purpose, or not read at all (another adapter than the graph's).
        unchecked = at_current | {name for name in self.checkpoints if name not in graph.versions}
        # A sharded checkpoint that stepped since the forward changed its live shards in place; the replay reads
        # the snapshot swapped in below, which holds the forward's values.
        snapshots = [s for name, s in graph.snapshots.items() if name not in at_current]
        unchecked |= {name for name in graph.snapshots if name not in at_current}
        rerun = Rerun(
            lambda call, topk_ids: self._rerun(call, topk_ids, weights),
            frozenset(id(p) for name in unchecked for p in self.checkpoints[name].parameters().values()),
            expected=None if at_current else used,
        )

        def cotangents_for(outputs):
            if not at_current:
                return cotangents
            low, high = self.staleness.importance_low, self.staleness.importance_high
            recorded = cast("ReplayingState", state).recorded_outputs  # a replay, as asserted above
            return {
                name: cotangent * importance_weights(outputs[name], recorded[name], low, high)
                if name in IMPORTANCE_WEIGHTED
                else cotangent
                for name, cotangent in cotangents.items()
            }

        try:
            with contextlib.ExitStack() as swaps:
                for snapshot in snapshots:  # collective: every rank holds the same graphs, so the same snapshots
                    swaps.enter_context(snapshot.swapped_in())
                grads = state.differentiate(inputs, cotangents_for, keep_graph=keep_graph, rerun=rerun)
        except BackwardStateError as error:
            raise type(error)(f"graph {graph.graph_id}: {error}") from None
        if self.planner.measuring:
            self.planner.observe(None, state.backward_evidence())
        return {key: g for key, g in zip(keys, grads) if g is not None}

    def _rerun(
        self, call: ForwardCall, topk_ids: torch.Tensor | None, weights: Mapping[str, Mapping[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        """Run the forward again with each checkpoint at `weights` (the live ones unless a snapshot is due).

        While the planner measures, a replay is a forward with grad like any
        other: its time and the bytes its graph saved are evidence too.
        """
        # The replay restores the module state the forward read, and the caller's after it: peft's active
        # adapter with it. The registry's record of which adapter is active must follow.
        active = self._active_adapter
        try:
            with self.weights_swapped_in(weights):
                if not self.planner.measuring:
                    return self._run(call, topk_ids)
                with Stopwatch(call.input_ids.device) as watch:
                    outputs = self._run(call, topk_ids)
        finally:
            self._active_adapter = active
        weight_storages = {
            local_tensor(t).untyped_storage().data_ptr() for tensors in weights.values() for t in tensors.values()
        }
        self.planner.observe(
            _graph_shape(call),
            Evidence(
                forward_s=watch.seconds,
                saved_bytes=saved_tensor_bytes(
                    outputs, self._parameter_storages() | weight_storages, self._weight_impls
                ),
            ),
        )
        return outputs

    # -- optimizer step ----------------------------------------------------------

    def _hand_over_weights(self, checkpoint: Checkpoint) -> None:
        """Before the checkpoint's weights change: live graphs that may still be differentiated keep the old ones."""
        holders = [
            graph
            for graph in self.graphs.live()
            if graph.holds_weights_of(checkpoint.name, checkpoint.version)
            and self.staleness.usable_after_step(graph.versions[checkpoint.name], checkpoint.version)
        ]
        if not holders:
            return
        # A sharded engine holds the parameter objects, so they stay, and its backward reads a snapshot instead.
        snapshot = self.parallelism.snapshot(checkpoint.parameters().values())
        if snapshot is None:
            checkpoint.detach_revision()
            return
        for graph in holders:
            graph.snapshots[checkpoint.name] = snapshot

    def _expire_graphs(self) -> None:
        """Release every graph that can never be differentiated again: its weights and saved tensors go now.
        A stale graph that kept a replay (importance policy) drops its saved tensors: it will be replayed."""
        current = self._current_versions()
        for graph in self.graphs.live():
            if self.staleness.expired(graph.versions, current):
                graph.release("expired")
            elif graph.stale_replay is not None and self.staleness.is_stale(graph.versions, current):
                graph.replay_from_now_on()

    def step(
        self,
        names: Iterable[str] | None = None,
        *,
        learning_rate: float | None = None,
        schedule_step: int | None = None,
    ) -> dict[str, StepReport]:
        """Reduce gradients over ranks; if every selected checkpoint's norm is finite, clip and step each one's AdamW.

        A non-finite norm anywhere skips the update of every checkpoint on every
        rank (the reports say why); a checkpoint with no gradient on any rank does
        not step. Every rank must select the same checkpoints with the same settings.

        `learning_rate` is the rate of every checkpoint without a schedule of its own (`OptimizerConfig.schedule`);
        one with a schedule takes its rate at `schedule_step` (a run passes its global step; unset: the
        checkpoint's revision). Each report says the rate it used.
        """
        selected = list(self.checkpoints) if names is None else list(names)
        unknown = [name for name in selected if name not in self.checkpoints]
        if unknown:
            raise ValueError(f"unknown checkpoint(s) {unknown}; registered: {sorted(self.checkpoints)}")
        self._expire_graphs()
        reports = step_checkpoints(
            [self.checkpoints[name] for name in selected],
            learning_rate,
            self._hand_over_weights,
            self.gradient_reduction,
            schedule_step,
        )
        self._expire_graphs()
        self.peak_saved_bytes = max(self.peak_saved_bytes, self.resident_bytes())  # snapshots handed over
        return reports

    def zero_grad(self) -> None:
        for checkpoint in self.checkpoints.values():
            checkpoint.clear_gradients()
        self.gradient_reduction.clear()

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1


def _graph_shape(call: ForwardCall) -> GraphShape:
    """What the planner's estimate is a function of: the padded input shape and what is computed."""
    seq_len = call.input_ids.shape[-1]
    return GraphShape(
        call.input_ids.numel() // max(seq_len, 1),
        seq_len,
        f"{','.join(call.outputs)}|k={call.top_k}|adapter={call.adapter}",
    )
