"""The trainer API: forward now, compute a loss later, step in between, still get correct gradients.

    trainer = Trainer(model)
    trainer.add_base_checkpoint()                   # or add_lora_checkpoint / add_module_checkpoint
    out = trainer.forward(input_ids, attention_mask, outputs=("logprobs",), mode="replay")
    loss = my_loss(out.logprobs, …)                 # any graph that ends at managed outputs
    trainer.backward(loss)                          # cotangents → each forward's graph → staged → committed
    trainer.step()                                  # AdamW per checkpoint, versions advance

Gradients are summed over ranks at `step`; normalise the loss accordingly.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .checkpoints import Checkpoint, OptimizerConfig, StepReport, trainable_names
from .distributed import all_reduce_sum_
from .graphs import GRAPH_ATTRIBUTE, ForwardCall, GraphRecord, GraphTable, ManagedOutputs, find_managed_leaves, make_leaf
from .memory.offload import OffloadHooks, OffloadTarget
from .memory.planner import BACKWARD_MODES, BackwardMode, MemoryPlanner
from .memory.replay import ReplayState
from .staleness import StalenessPolicy, graph_age, importance_weights
from .transaction import NonFinitePolicy, StagedGradients, agree_across_ranks

OUTPUT_KINDS = ("logprobs", "topk", "logits", "hidden", "heads")
# Internal output name → ManagedOutputs field.
_OUTPUT_FIELDS = {"logprobs": "logprobs", "topk": "topk_logprobs", "logits": "logits", "hidden": "hidden_states"}


class GraphConsumedError(RuntimeError):
    """A forward's graph was already used by a backward without retain_graph=True."""


@dataclass(frozen=True)
class BackwardReport:
    num_graphs: int
    ages: dict[int, dict[str, int]]
    """Per graph id, its age in optimizer steps per checkpoint."""
    num_gradients: int


class _SavedBytesCounter:
    """Counts the distinct non-parameter storages autograd saves (retain mode)."""

    def __init__(self, keep: set[int]):
        self._keep, self._seen, self.bytes = keep, set(), 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._keep and key not in self._seen:
            self._seen.add(key)
            self.bytes += storage.nbytes()
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


class Trainer:
    def __init__(
        self,
        model: nn.Module,
        *,
        staleness: StalenessPolicy | None = None,
        planner: MemoryPlanner | None = None,
        offload_target: OffloadTarget | None = None,
        nonfinite: NonFinitePolicy = "error",
    ):
        self.model = model
        self.staleness = staleness or StalenessPolicy()
        self.planner = planner or MemoryPlanner()
        device = next(model.parameters()).device
        # On a CPU-only machine host memory *is* device memory: offload to disk.
        self.offload_target: OffloadTarget = offload_target or ("host" if device.type == "cuda" else "disk")
        self.nonfinite = nonfinite
        self.checkpoints: dict[str, Checkpoint] = {}
        self.heads: dict[str, nn.Module] = {}
        self.graphs = GraphTable()
        self.peak_saved_bytes = 0

    # -- checkpoints -------------------------------------------------------------

    def _add(self, checkpoint: Checkpoint) -> Checkpoint:
        if checkpoint.name in self.checkpoints:
            raise ValueError(f"a checkpoint named '{checkpoint.name}' is already registered; choose another name")
        self.checkpoints[checkpoint.name] = checkpoint
        return checkpoint

    def add_base_checkpoint(self, name: str = "base", optimizer: OptimizerConfig = OptimizerConfig()) -> Checkpoint:
        """Full fine-tuning: every trainable parameter of the model."""
        return self._add(Checkpoint(name, "base", self.model, trainable_names(self.model), optimizer))

    def add_lora_checkpoint(self, name: str, lora_config, optimizer: OptimizerConfig = OptimizerConfig()) -> Checkpoint:
        """A LoRA adapter injected with peft; the base weights it adapts stay frozen."""
        from peft import inject_adapter_in_model

        for param in self.model.parameters():
            if not any(param is p for c in self.checkpoints.values() for p in c.parameters().values()):
                param.requires_grad_(False)
        inject_adapter_in_model(lora_config, self.model, adapter_name=name)
        names = [n for n in trainable_names(self.model) if f".{name}." in n and "lora_" in n]
        checkpoint = self._add(Checkpoint(name, "lora", self.model, names, optimizer))
        checkpoint.adapter_config = lora_config
        return checkpoint

    def add_module_checkpoint(self, name: str, module: nn.Module, optimizer: OptimizerConfig = OptimizerConfig()) -> Checkpoint:
        """A custom head applied to the last hidden state; `out.heads[name]` is its output."""
        module.to(next(self.model.parameters()).device)
        self.heads[name] = module
        return self._add(Checkpoint(name, "module", module, trainable_names(module), optimizer))

    def _param_storages(self) -> set[int]:
        storages = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        storages |= {p.untyped_storage().data_ptr() for h in self.heads.values() for p in h.parameters()}
        return storages

    # -- forward -----------------------------------------------------------------

    def _compute(self, call: ForwardCall, weights: dict[str, dict[str, torch.Tensor]] | None) -> dict[str, torch.Tensor]:
        """Run the model (at `weights` when given, else the live parameters) and derive the outputs."""
        wants = set(call.outputs)
        need_hidden = "hidden" in wants or ("heads" in wants and self.heads)
        kwargs = dict(input_ids=call.input_ids, attention_mask=call.attention_mask, output_hidden_states=bool(need_hidden))
        if call.position_ids is not None:
            kwargs["position_ids"] = call.position_ids
        model_weights = {}
        if weights is not None:
            for name, tensors in weights.items():
                if self.checkpoints[name].kind != "module":
                    model_weights.update(tensors)
        if model_weights:
            result = torch.func.functional_call(self.model, model_weights, args=(), kwargs=kwargs, strict=False)
        else:
            result = self.model(**kwargs)
        logits = result.logits
        targets = call.targets if call.targets is not None else call.input_ids[:, 1:]
        target_logits = logits if call.targets is not None else logits[:, :-1]
        out: dict[str, torch.Tensor] = {}
        if "logits" in wants:
            out["logits"] = logits
        if "logprobs" in wants:
            vocab = target_logits.shape[-1]
            # cross_entropy is fused and saves only the logits, unlike log_softmax + gather.
            nll = F.cross_entropy(target_logits.reshape(-1, vocab).float(), targets.reshape(-1), reduction="none", ignore_index=-100)
            out["logprobs"] = -nll.view(targets.shape)
        if "topk" in wants and call.top_k > 0:
            values, ids = torch.log_softmax(target_logits.float(), dim=-1).topk(call.top_k, dim=-1)
            out["topk"], out["topk_ids"] = values, ids
        if need_hidden:
            hidden = result.hidden_states[-1]
            if "hidden" in wants:
                out["hidden"] = hidden
            for name, head in self.heads.items() if "heads" in wants else ():
                head_weights = (weights or {}).get(name)
                out[f"head:{name}"] = (
                    torch.func.functional_call(head, head_weights, args=(hidden,)) if head_weights else head(hidden)
                )
        return out

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
    ) -> ManagedOutputs:
        """Run the model and return managed outputs; `mode` None lets the planner choose.

        Without `targets`, `logprobs[:, t]` is the log-probability of `input_ids[:, t+1]`.
        """
        outputs = tuple(outputs)
        unknown = set(outputs) - set(OUTPUT_KINDS)
        if unknown:
            raise ValueError(f"unknown outputs {sorted(unknown)}; choose from {OUTPUT_KINDS}")
        if "topk" in outputs and top_k <= 0:
            raise ValueError("outputs include 'topk' but top_k=0; pass top_k=K")
        call = ForwardCall(input_ids, attention_mask, position_ids, targets, outputs, top_k)
        resident = self.graphs.resident_saved_bytes()
        if mode is None:
            mode = self.planner.choose(call.num_tokens, resident)
        if mode not in BACKWARD_MODES:
            raise ValueError(f"mode={mode!r}; choose one of {BACKWARD_MODES} or None for the planner")
        graph_id = self.graphs.new_id()
        versions = {name: c.version for name, c in self.checkpoints.items()}
        weights = {name: dict(c.parameters()) for name, c in self.checkpoints.items()}
        keep = self._param_storages()
        record = GraphRecord(graph_id, mode, versions, weights, call)
        started = time.perf_counter()
        if mode == "replay":
            record.replay = ReplayState.capture(input_ids.device, [input_ids, attention_mask, position_ids, targets])
            with torch.no_grad():
                values = self._compute(call, None)
            record.saved_bytes = record.replay.saved_bytes
            record.holds_weights = self.staleness.stale_mode == "snapshot"
            if not record.holds_weights:
                record.weights = {}
            self.planner.observe_forward(time.perf_counter() - started, call.num_tokens)
        elif mode == "offload":
            record.offload = OffloadHooks(self.offload_target, keep)
            with record.offload.hooks():
                values = self._compute(call, None)
            record.internal = values
            # Host offload on a CPU device moves nothing out of device memory.
            resident = self.offload_target == "host" and not input_ids.is_cuda
            record.saved_bytes = record.offload.offloaded_bytes if resident else 0
            self.planner.observe_offload(record.offload.offloaded_bytes, time.perf_counter() - started)
        else:
            counter = _SavedBytesCounter(keep)
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                values = self._compute(call, None)
            record.internal = values
            record.saved_bytes = counter.bytes
            self.planner.observe_retained(counter.bytes, call.num_tokens)
        if "logprobs" in values:
            record.recorded_logprobs = values["logprobs"].detach()
        managed = ManagedOutputs(graph_id=graph_id, versions=versions)
        leaves = []
        for name, value in values.items():
            if name == "topk_ids":
                managed.topk_ids = value
                continue
            leaf = make_leaf(value, graph_id, name)
            leaves.append(leaf)
            if name.startswith("head:"):
                managed.heads[name.removeprefix("head:")] = leaf
            else:
                setattr(managed, _OUTPUT_FIELDS[name], leaf)
        self.graphs.add(record, leaves)
        self.peak_saved_bytes = max(self.peak_saved_bytes, self.graphs.resident_saved_bytes())
        return managed

    # -- backward ----------------------------------------------------------------

    def _differentiate(self, record: GraphRecord, cotangents: dict[str, torch.Tensor], ages: dict[str, int],
                       keep_graph: bool = True) -> dict[tuple[str, str], torch.Tensor]:
        stale = any(ages.values())
        if record.mode == "replay":
            # Stale with snapshots: re-run at the weights the forward used. Otherwise
            # (fresh, or the importance policy) at the live weights — for a fresh
            # graph those are the very tensors the forward used.
            at_recorded = stale and self.staleness.stale_mode == "snapshot"
            weights = record.weights if at_recorded else {n: dict(c.parameters()) for n, c in self.checkpoints.items()}
            with record.replay.restored():
                internal = self._compute(record.call, weights if at_recorded else None)
            if stale and not at_recorded and "logprobs" in cotangents:
                w = importance_weights(internal["logprobs"], record.recorded_logprobs, self.staleness.importance_low, self.staleness.importance_high)
                cotangents = {**cotangents, "logprobs": cotangents["logprobs"] * w}
        else:
            internal = record.internal
            weights = record.weights
        names = list(cotangents)
        keys = [(c, p) for c, tensors in weights.items() for p, t in tensors.items() if t.requires_grad]
        inputs = [weights[c][p] for c, p in keys]
        grads = torch.autograd.grad(
            [internal[n] for n in names], inputs, grad_outputs=[cotangents[n] for n in names],
            retain_graph=keep_graph, allow_unused=True,
        )
        return {key: g for key, g in zip(keys, grads) if g is not None}

    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False) -> BackwardReport:
        """Push the loss's cotangents through every forward it depends on, as one transaction."""
        leaves = find_managed_leaves(loss)
        if not leaves:
            raise ValueError("the loss depends on no managed output; build it from the outputs of trainer.forward(...)")
        cotangents = torch.autograd.grad(loss, leaves, allow_unused=True)
        by_graph: dict[int, dict[str, torch.Tensor]] = {}
        for leaf, cotangent in zip(leaves, cotangents):
            if cotangent is not None:
                graph_id, name = getattr(leaf, GRAPH_ATTRIBUTE)
                by_graph.setdefault(graph_id, {})[name] = cotangent
        staged = StagedGradients(self.checkpoints)
        ages: dict[int, dict[str, int]] = {}
        error: BaseException | None = None
        # Saved tensors are freed as autograd goes unless kept. Keep them when a
        # later graph of this backward could fail and the whole backward be
        # retried; a lone graph frees them, as plain autograd does (lower peak).
        keep_graph = retain_graph or len(by_graph) > 1
        entered: list[int] = []
        try:
            for graph_id, graph_cotangents in by_graph.items():
                record = self.graphs.get(graph_id)
                if record is None or record.consumed:
                    raise GraphConsumedError(
                        f"graph {graph_id} was already used by a backward; pass retain_graph=True to backward it again"
                    )
                ages[graph_id] = {
                    name: graph_age(name, record.versions[name], checkpoint.version, self.staleness)
                    for name, checkpoint in self.checkpoints.items() if name in record.versions
                }
                entered.append(graph_id)
                for (checkpoint, param), grad in self._differentiate(record, graph_cotangents, ages[graph_id], keep_graph).items():
                    staged.add(checkpoint, param, grad)
            staged.validate(self.nonfinite)
        except Exception as failure:  # noqa: BLE001 - every rank must hear of it before anyone raises
            error = failure
            if not keep_graph:
                for graph_id in entered:  # its saved tensors may be gone: no retry
                    self.graphs.get(graph_id).consumed = True
        agree_across_ranks(error)
        num_gradients = len(staged)
        staged.commit()
        if not retain_graph:
            for graph_id in by_graph:
                record = self.graphs.get(graph_id)
                record.consumed = True
                record.release()
        return BackwardReport(len(by_graph), ages, num_gradients)

    # -- optimizer step ----------------------------------------------------------

    def _live_graphs_hold(self, checkpoint: Checkpoint) -> bool:
        return any(
            not r.consumed and r.holds_weights and r.versions.get(checkpoint.name) == checkpoint.version
            for r in self.graphs.live()
        )

    def step(self, names: Iterable[str] | None = None, *, learning_rate: float | None = None) -> dict[str, StepReport]:
        """Reduce gradients over ranks, then clip and step each checkpoint's AdamW."""
        reports = {}
        for name in list(names) if names is not None else list(self.checkpoints):
            checkpoint = self.checkpoints[name]
            if self.world_size > 1:
                # Every rank must reduce the same tensors, even one whose batch missed a parameter.
                for param in checkpoint.parameters().values():
                    if param.grad is None:
                        param.grad = torch.zeros_like(param)
            all_reduce_sum_(checkpoint.grads())
            if self.staleness.max_gradient_staleness > 0 and self._live_graphs_hold(checkpoint):
                checkpoint.detach_revision()
            reports[name] = checkpoint.step(learning_rate)
        return reports

    def zero_grad(self) -> None:
        for checkpoint in self.checkpoints.values():
            checkpoint.optimizer.zero_grad(set_to_none=True)

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1
