"""Checkpoints: named sets of trainable parameters, each with its own AdamW and version.

A checkpoint owns parameters of a module: the whole base model (full
fine-tuning), the LoRA adapter peft injected into it, or a custom module the
caller registered (a value head). Its parameters train, version, save, restore
and export with it.

Before an optimizer step, if live graphs still reference the current weights
and may be differentiated later (bounded staleness), the checkpoint *detaches
the revision*: the tensors those graphs saved keep their values, and the
optimizer continues on fresh copies. That copy is the snapshot the DESIGN
speaks of: one copy of the checkpoint's parameters per revision that live
graphs still hold — cheap for an adapter or a head, a full copy of the
weights per such revision for full fine-tuning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from .versions import Version, new_identity

CheckpointKind = Literal["base", "lora", "module"]


@dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    """Global-norm clipping of this checkpoint's gradient (0 disables)."""


@dataclass(frozen=True)
class StepReport:
    checkpoint: str
    stepped: bool
    grad_norm: float
    version: Version
    """The version after the step (unchanged when the update was skipped)."""


def _resolve(owner: nn.Module, qualified: str) -> tuple[nn.Module, str]:
    module_path, _, attr = qualified.rpartition(".")
    return (owner.get_submodule(module_path) if module_path else owner), attr


class Checkpoint:
    def __init__(self, name: str, kind: CheckpointKind, owner: nn.Module, param_names: list[str], optimizer: OptimizerConfig):
        if not param_names:
            raise ValueError(f"checkpoint '{name}' has no trainable parameters; register a module with requires_grad parameters")
        self.name = name
        self.kind = kind
        self.owner = owner
        self.optimizer_config = optimizer
        # Aliases (tied weights) share one Parameter; keep every name of each.
        named = dict(owner.named_parameters(remove_duplicate=False))
        self.param_names = [n for n in param_names if n in named]
        self._aliases: dict[str, list[str]] = {}
        canonical: dict[int, str] = {}
        for qualified in self.param_names:
            first = canonical.setdefault(id(named[qualified]), qualified)
            self._aliases.setdefault(first, []).append(qualified)
        self.identity = new_identity()
        self.revision = 0
        self.optimizer = self._new_optimizer()
        self.adapter_config = None
        """For a LoRA checkpoint, the peft LoraConfig it was injected with (exported beside it)."""

    def _new_optimizer(self) -> torch.optim.AdamW:
        c = self.optimizer_config
        return torch.optim.AdamW(list(self.parameters().values()), lr=c.learning_rate, betas=c.betas, eps=c.eps,
                                 weight_decay=c.weight_decay)

    @property
    def version(self) -> Version:
        return Version(self.identity, self.revision)

    def parameters(self) -> dict[str, nn.Parameter]:
        """The live parameters, one entry per distinct tensor (tied aliases folded)."""
        return {name: self.owner.get_parameter(name) for name in self._aliases}

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.parameters().values() if p.grad is not None]

    def detach_revision(self) -> None:
        """Give the optimizer fresh parameter tensors; the old ones keep this revision's values."""
        for canonical, aliases in self._aliases.items():
            old = self.owner.get_parameter(canonical)
            new = nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad)
            new.grad, old.grad = old.grad, None
            for qualified in aliases:
                module, attr = _resolve(self.owner, qualified)
                module._parameters[attr] = new
            for group in self.optimizer.param_groups:
                group["params"] = [new if p is old else p for p in group["params"]]
            if old in self.optimizer.state:
                self.optimizer.state[new] = self.optimizer.state.pop(old)

    def step(self, learning_rate: float | None = None) -> StepReport:
        """Clip and apply the accumulated (already reduced) gradient, then clear it.

        A non-finite norm skips the update; since every rank holds the same
        reduced gradient, every rank skips.
        """
        params = [p for p in self.parameters().values() if p.grad is not None]
        clip = self.optimizer_config.grad_clip if self.optimizer_config.grad_clip > 0 else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip)) if params else 0.0
        stepped = math.isfinite(norm) and bool(params)
        if stepped:
            if learning_rate is not None:
                for group in self.optimizer.param_groups:
                    group["lr"] = learning_rate
            self.optimizer.step()
            self.revision += 1
        self.optimizer.zero_grad(set_to_none=True)
        return StepReport(self.name, stepped, norm, self.version)

    def state_dict(self) -> dict:
        return {
            "params": {n: p.detach().clone() for n, p in self.parameters().items()},
            "optimizer": self.optimizer.state_dict(),
            "revision": self.revision,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore weights and optimizer state. The identity changes: graphs from before are void."""
        with torch.no_grad():
            for name, param in self.parameters().items():
                if name not in state["params"]:
                    raise KeyError(f"checkpoint '{self.name}': saved state lacks parameter {name}")
                param.copy_(state["params"][name])
        if state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.revision = int(state["revision"])
        self.identity = new_identity()

    def replace(self, params: dict[str, torch.Tensor]) -> None:
        """Load new weights with a fresh optimizer: a new identity, revision 0."""
        with torch.no_grad():
            for name, param in self.parameters().items():
                param.copy_(params[name])
        self.optimizer = self._new_optimizer()
        self.identity, self.revision = new_identity(), 0


def trainable_names(module: nn.Module, prefix_filter: str | None = None) -> list[str]:
    return [n for n, p in module.named_parameters() if p.requires_grad and (prefix_filter is None or prefix_filter in n)]
