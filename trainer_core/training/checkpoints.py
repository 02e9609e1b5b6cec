"""Checkpoints: named sets of trainable parameters, each with its own AdamW and version.

A checkpoint owns parameters of a module: the whole base model (full
fine-tuning), the LoRA adapter peft injected into it, or a custom module the
caller registered (a value head). Its parameters train, version, save, restore
and export with it.

Ownership is by identity: a checkpoint holds the Parameter objects themselves
and every place (module, attribute) that holds each one — not names, which
change when peft wraps a layer (`q_proj.weight` becomes
`q_proj.base_layer.weight`). Names are kept only as stable keys for saving.

Low-precision parameters (bf16, fp16) train through FP32 master weights: the
optimizer (and its moments) works on an FP32 copy, and the parameter gets the
master's value cast back after every step, so an update far below the
parameter's resolution still accumulates.

Before an optimizer step, if live graphs still reference the current weights
and may be differentiated later (bounded staleness), the checkpoint *detaches
the revision*: the tensors those graphs saved keep their values, and the
optimizer continues on fresh copies, written into every place the forward
reads them from. That copy is the snapshot the DESIGN speaks of.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch
from torch import nn

from ..lr_schedule import LRSchedule
from ..parallel import is_distributed, local_tensor, whole
from .versions import Version, new_identity

CheckpointKind = Literal["base", "lora", "module"]
LOW_PRECISION = (torch.bfloat16, torch.float16)


@runtime_checkable
class ShapedTensors(Protocol):
    """Tensors by name that tell their shapes without being read (a safetensors file's, from its header)."""

    def shapes(self) -> Mapping[str, Sequence[int]]: ...


@dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    """Global-norm clipping of this checkpoint's gradient (0 disables)."""
    schedule: LRSchedule | None = None
    """This checkpoint's own schedule: its rate at each step is `learning_rate * schedule.multiplier(step)`, whatever
    rate `step(learning_rate=...)` gives the others. None: the rate the step gives, or `learning_rate` throughout."""


@dataclass(frozen=True)
class StepReport:
    checkpoint: str
    stepped: bool
    grad_norm: float
    version: Version
    """The version after the step (unchanged when the update was skipped)."""
    skipped_reason: str | None = None
    """Why the update was skipped: "no gradient", or the non-finite norm that stopped every checkpoint."""
    learning_rate: float | None = None
    """The rate of the step (the one it would have had, where it was skipped)."""


class _Slot:
    """One distinct parameter: the live tensor, every (module, attribute) holding it, its FP32 master."""

    __slots__ = ("name", "param", "locations", "master")

    def __init__(self, name: str, param: nn.Parameter, locations: list[tuple[nn.Module, str]]):
        self.name, self.param, self.locations = name, param, locations
        self.master: torch.Tensor | None = (
            param.detach().float().clone().requires_grad_(param.requires_grad) if param.dtype in LOW_PRECISION else None
        )

    @property
    def optimized(self) -> torch.Tensor:
        """The tensor AdamW updates: the FP32 master, or the parameter itself."""
        return self.master if self.master is not None else self.param


def _locations(root: nn.Module, params: Sequence[nn.Parameter]) -> dict[int, list[tuple[nn.Module, str]]]:
    wanted = {id(p) for p in params}
    found: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in root.modules():
        for attribute, param in module._parameters.items():
            if param is not None and id(param) in wanted:
                found.setdefault(id(param), []).append((module, attribute))
    return found


class Checkpoint:
    def __init__(
        self,
        name: str,
        kind: CheckpointKind,
        owner: nn.Module,
        params: Sequence[tuple[str, nn.Parameter]],
        optimizer: OptimizerConfig,
    ):
        if not params:
            raise ValueError(
                f"checkpoint '{name}' has no trainable parameters; register a module with requires_grad parameters"
            )
        self.name = name
        self.kind = kind
        self.owner = owner
        self.optimizer_config = optimizer
        distinct: dict[int, tuple[str, nn.Parameter]] = {}
        for qualified, param in params:  # tied weights: one slot under the first name
            distinct.setdefault(id(param), (qualified, param))
        locations = _locations(owner, [p for _, p in distinct.values()])
        self._slots = [_Slot(qualified, param, locations[id(param)]) for qualified, param in distinct.values()]
        self.identity = new_identity()
        self.revision = 0
        self._pending_optimizer_state: Future | None = None
        self.optimizer = self._new_optimizer()
        self.adapter_config = None
        """For a LoRA checkpoint, the peft LoraConfig it was injected with (exported beside it)."""

    @property
    def optimizer(self) -> torch.optim.AdamW:
        """The checkpoint's AdamW; a restored state still being read (`load_state_dict` given a `Future`) is waited
        for and loaded at its first use, which for a resumed segment is the first optimizer step."""
        self.finish_restore()
        return self._optimizer

    def finish_restore(self) -> None:
        """Load a restored optimizer state still being read (waiting for the read); nothing where none is.

        Pending until loaded: a read or a load that failed raises again at every use, never a fresh AdamW in its
        place. The step calls it on every checkpoint before any of them changes (all or none)."""
        if self._pending_optimizer_state is not None:
            self._optimizer.load_state_dict(self._pending_optimizer_state.result())
            self._pending_optimizer_state = None

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.AdamW) -> None:
        self._optimizer = optimizer
        self._pending_optimizer_state = None

    def _new_optimizer(self) -> torch.optim.AdamW:
        c = self.optimizer_config
        return torch.optim.AdamW(
            [s.optimized for s in self._slots],
            lr=c.learning_rate,
            betas=c.betas,
            eps=c.eps,
            weight_decay=c.weight_decay,
        )

    @property
    def version(self) -> Version:
        return Version(self.identity, self.revision)

    def parameters(self) -> dict[str, nn.Parameter]:
        """The live parameters, one entry per distinct tensor (tied aliases folded), by their registration names."""
        return {slot.name: slot.param for slot in self._slots}

    def master_weights(self) -> dict[str, torch.Tensor]:
        """The FP32 masters of low-precision parameters."""
        return {slot.name: slot.master for slot in self._slots if slot.master is not None}

    def optimized_parameters(self) -> dict[str, torch.Tensor]:
        """The tensors AdamW updates (the FP32 master where there is one), by parameter name, in `parameters()` order."""
        return {slot.name: slot.optimized for slot in self._slots}

    def has_gradient(self) -> list[bool]:
        return [slot.param.grad is not None for slot in self._slots]

    def clear_gradients(self) -> None:
        for slot in self._slots:
            slot.param.grad = None
            if slot.master is not None:
                slot.master.grad = None

    # -- the step, in the order the trainer drives it -----------------------------

    def gather_gradients(self, present_anywhere: Sequence[bool]) -> list[torch.Tensor]:
        """Move gradients onto the optimized tensors (FP32 for masters) and return them, ready to be summed over ranks.

        A parameter without a local gradient gets zeros when another rank has
        one (every rank reduces the same tensors); one that no rank has a
        gradient for keeps none, so AdamW leaves it alone as torch's does.
        """
        grads = []
        for slot, anywhere in zip(self._slots, present_anywhere, strict=True):
            grad = slot.param.grad
            if grad is None and not anywhere:
                continue
            if grad is None:
                grad = torch.zeros_like(slot.optimized)
            if slot.master is not None:
                slot.master.grad = grad.float()
                slot.param.grad = None
            else:
                slot.param.grad = grad
            grads.append(slot.optimized.grad)
        return grads

    def gradient_norm(self, *, canonical: bool = False) -> torch.Tensor | None:
        """The global L2 norm of the (reduced) gradient, as torch's clip_grad_norm_ computes it; None without one.

        `canonical`: `ranks.canonical_norm` instead, whose bits depend neither on W nor on sharding (both
        deterministic reductions ask for it, sharded and unsharded: the two then agree to the bit when clipping)."""
        grads = [s.optimized.grad for s in self._slots if s.optimized.grad is not None]
        if not grads:
            return None
        if canonical:
            from ..ranks.canonical_norm import canonical_norm  # ranks imports training: not at module load

            return canonical_norm(grads)
        # Sharded: a partial norm per rank; the whole one (collective, every rank steps) is what clips, and a
        # non-finite shard anywhere makes it non-finite on every rank.
        return whole(torch.nn.utils.get_total_norm(grads))

    def apply(self, norm: torch.Tensor, learning_rate: float) -> None:
        """Clip with the precomputed norm and take one AdamW step at `learning_rate`; the revision advances."""
        clip = self.optimizer_config.grad_clip
        tensors = [s.optimized for s in self._slots if s.optimized.grad is not None]
        if clip > 0 and any(is_distributed(t) for t in tensors):
            _clip_shards(tensors, clip, norm)
        elif clip > 0:
            torch.nn.utils.clip_grads_with_norm_(tensors, clip, norm)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate
        self.optimizer.step()
        with torch.no_grad():
            for slot in self._slots:
                if slot.master is not None:
                    slot.param.copy_(slot.master)
        self.revision += 1
        self.clear_gradients()

    def learning_rate(self, override: float | None, schedule_step: int | None = None) -> float:
        """The rate of the next step: the checkpoint's own schedule at `schedule_step` (its revision, the updates
        applied so far, where the step names none), else `override`, else the optimizer's current rate."""
        schedule = self.optimizer_config.schedule
        if schedule is not None:
            at = self.revision if schedule_step is None else schedule_step
            return self.optimizer_config.learning_rate * schedule.multiplier(at)
        return override if override is not None else self.optimizer.param_groups[0]["lr"]

    def detach_revision(self) -> None:
        """Give the optimizer fresh parameter tensors; the old ones keep this revision's values for live graphs."""
        self._refuse_sharded("detach_revision")
        for slot in self._slots:
            old = slot.param
            new = nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad)
            new.grad, old.grad = old.grad, None
            self._relocate(slot, new)
            if slot.master is None:  # the optimizer's key is the parameter itself
                for group in self.optimizer.param_groups:
                    group["params"] = [new if p is old else p for p in group["params"]]
                if old in self.optimizer.state:
                    self.optimizer.state[new] = self.optimizer.state.pop(old)

    def _refuse_sharded(self, what: str) -> None:
        """A sharded engine binds the module's parameter objects to its units: replacing one would leave it gathering
        the old one. A sharded revision is kept as the parallelism's snapshot instead (the trainer does that)."""
        sharded = next((s.name for s in self._slots if is_distributed(s.param)), None)
        if sharded is not None:
            raise RuntimeError(
                f"checkpoint '{self.name}': {what} would replace the sharded parameter {sharded} that its sharded engine "
                "holds; keep a sharded revision with Parallelism.snapshot and swap it in around the backward"
            )

    def _where(self, slot: _Slot) -> list[tuple[nn.Module, str]]:
        """Every (module, attribute) the forward reads `slot.param` from — found again if peft re-wrapped a module."""
        if not all(module._parameters.get(attribute) is slot.param for module, attribute in slot.locations):
            slot.locations = _locations(self.owner, [slot.param]).get(id(slot.param), [])
            if not slot.locations:
                raise RuntimeError(
                    f"checkpoint '{self.name}': parameter {slot.name} is no longer part of its module; "
                    "do not replace registered parameters by hand"
                )
        return slot.locations

    def _relocate(self, slot: _Slot, new: nn.Parameter) -> None:
        for module, attribute in self._where(slot):
            module._parameters[attribute] = new
        slot.param = new

    @contextlib.contextmanager
    def swapped_in(self, tensors: Mapping[str, torch.Tensor]):
        """Run with `tensors` (e.g. a stale graph's weight snapshot) where the forward reads this checkpoint's weights."""
        swaps = [
            (module, attribute, tensors[slot.name], slot.param)
            for slot in self._slots
            if tensors[slot.name] is not slot.param
            for module, attribute in self._where(slot)
        ]
        if swaps:
            self._refuse_sharded("swapped_in")
        try:
            for module, attribute, tensor, _ in swaps:
                # A plain tensor (the snapshot) stands where the forward reads the parameter, for this block only;
                # torch types _parameters as holding Parameters alone.
                module._parameters[attribute] = tensor  # pyright: ignore[reportArgumentType]
            yield
        finally:
            for module, attribute, _, live in swaps:
                module._parameters[attribute] = live

    # -- state ----------------------------------------------------------------------

    def state_dict(self, *, copy: bool = True) -> dict:
        """Weights (the FP32 masters where there are masters), AdamW state and revision. The weights are copies
        unless `copy` is False (then the live tensors: for a writer that is done before the next step)."""
        weights = {s.name: (s.master if s.master is not None else s.param).detach() for s in self._slots}
        return {
            "params": {name: t.clone() for name, t in weights.items()} if copy else weights,
            "optimizer": self.optimizer.state_dict(),
            "revision": self.revision,
        }

    def _load_weights(self, params: Mapping[str, torch.Tensor]) -> None:
        # Every name and shape first: a state that does not fit is refused with nothing changed (`copy_` would
        # broadcast a (1, N) weight into an (M, N) parameter, and a missing one would leave the others loaded).
        shapes = params.shapes() if isinstance(params, ShapedTensors) else {n: t.shape for n, t in params.items()}
        for slot in self._slots:
            if slot.name not in shapes:
                raise KeyError(f"checkpoint '{self.name}': saved state lacks parameter {slot.name}")
            if tuple(shapes[slot.name]) != tuple(slot.param.shape):
                raise ValueError(
                    f"checkpoint '{self.name}': saved {slot.name} has shape {tuple(shapes[slot.name])}, the parameter "
                    f"{tuple(slot.param.shape)}; restore a state saved from this model"
                )
        with torch.no_grad():
            for slot in self._slots:
                slot.param.copy_(params[slot.name])
                if slot.master is not None:
                    slot.master.copy_(params[slot.name])

    def load_state_dict(self, state: dict) -> None:
        """Restore weights and optimizer state. The identity changes: graphs and gradients from before are void.

        `state["optimizer"]` may be a `Future` of the optimizer's state dict (a restore reading the AdamW moments
        beside the weights' copy and the first forward and backward): it is waited for and loaded at the
        optimizer's first use (`optimizer`), and a failure to read it is raised there.
        """
        self._load_weights(state["params"])
        optimizer = state.get("optimizer")
        if optimizer is not None:  # supersedes a read still pending; a weights-only load leaves it as it is
            self._pending_optimizer_state = None
        if isinstance(optimizer, Future):
            self._pending_optimizer_state = optimizer
        elif optimizer is not None:
            self._optimizer.load_state_dict(optimizer)
        self.revision = int(state["revision"])
        self.identity = new_identity()
        self.clear_gradients()

    def replace(self, params: dict[str, torch.Tensor]) -> None:
        """Load new weights with a fresh optimizer: a new identity, revision 0, no accumulated gradient."""
        self._load_weights(params)
        self.optimizer = self._new_optimizer()
        self.identity, self.revision = new_identity(), 0
        self.clear_gradients()


def _clip_shards(tensors: Sequence[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """`clip_grads_with_norm_` on each rank's local gradient shards: the same coefficient, computed as torch does,
    times each element (elementwise, so bitwise the unsharded result, and no collective)."""
    coefficient = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
    grads = [local_tensor(t.grad) for t in tensors if t.grad is not None]
    for grad in grads:  # one product per element, as torch's foreach multiply: the same bits
        grad.mul_(coefficient.to(grad.device))


def nonfinite_reason(norms: dict[str, float]) -> str | None:
    bad = {name: norm for name, norm in norms.items() if not math.isfinite(norm)}
    if not bad:
        return None
    listed = ", ".join(f"'{name}' ({norm})" for name, norm in bad.items())
    return f"non-finite gradient norm in checkpoint(s) {listed}; no checkpoint stepped"
