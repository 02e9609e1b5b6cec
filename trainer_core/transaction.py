"""Transactional gradients: stage, validate, agree across ranks, then commit at once.

Backward never writes into `.grad` while it runs. It stages every gradient,
validates the lot (shapes, dtypes, finiteness, that no checkpoint moved while
it ran), asks every rank whether it succeeded, and only then adds them all to
the accumulators. Any failure — an exception mid-backward, a rank that failed
— leaves every accumulator bitwise as it was.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from .checkpoints import Checkpoint
from .versions import Version

NonFinitePolicy = Literal["error", "allow"]


class GradientTransactionError(RuntimeError):
    """Backward was aborted; no accumulator changed. The message says which rank and why."""


class StagedGradients:
    def __init__(self, checkpoints: dict[str, Checkpoint]):
        self._checkpoints = checkpoints
        self._versions: dict[str, Version] = {name: c.version for name, c in checkpoints.items()}
        self._grads: dict[tuple[str, str], torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._grads)

    def add(self, checkpoint: str, param: str, grad: torch.Tensor) -> None:
        key = (checkpoint, param)
        current = self._grads.get(key)
        self._grads[key] = grad if current is None else current + grad

    def _by_checkpoint(self):
        """(checkpoint, {param: live tensor}, [(param, grad)]) — the live dict built once per checkpoint."""
        grouped: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for (checkpoint, param), grad in self._grads.items():
            grouped.setdefault(checkpoint, []).append((param, grad))
        for checkpoint, items in grouped.items():
            yield checkpoint, self._checkpoints[checkpoint].parameters(), items

    def validate(self, nonfinite: NonFinitePolicy) -> None:
        for name, checkpoint in self._checkpoints.items():
            if checkpoint.version != self._versions[name]:
                raise GradientTransactionError(
                    f"checkpoint '{name}' moved from {self._versions[name]} to {checkpoint.version} during backward; "
                    "do not step while a backward runs"
                )
        for checkpoint, live, items in self._by_checkpoint():
            for param, grad in items:
                if grad.shape != live[param].shape or grad.dtype != live[param].dtype:
                    raise GradientTransactionError(
                        f"checkpoint '{checkpoint}' parameter {param}: gradient {tuple(grad.shape)}/{grad.dtype} does not "
                        f"match the parameter {tuple(live[param].shape)}/{live[param].dtype}"
                    )
            # One fused test over all gradients (a non-finite element makes its sum
            # non-finite); the per-tensor pass runs only then, to name the culprit
            # (or to clear a sum that merely overflowed).
            if nonfinite == "error" and not bool(torch.stack([g.sum() for _, g in items]).isfinite().all()):
                culprit = next((p for p, g in items if not bool(torch.isfinite(g).all())), None)
                if culprit is None:
                    continue
                raise GradientTransactionError(
                    f"checkpoint '{checkpoint}' parameter {culprit}: non-finite gradient; fix the loss, or construct the "
                    "trainer with nonfinite='allow' to let the optimizer step skip it"
                )

    def commit(self) -> None:
        with torch.no_grad():
            for _, live, items in self._by_checkpoint():
                for param, grad in items:
                    target = live[param]
                    if target.grad is None:
                        target.grad = grad.detach()
                    else:
                        target.grad.add_(grad)
        self._grads.clear()


def agree_across_ranks(error: BaseException | None) -> None:
    """Raise on every rank if any rank failed, naming the failing ranks; never hang on one.

    A rank that failed re-raises its own error (its type tells the caller what
    went wrong); the others raise GradientTransactionError naming it.
    """
    if dist.is_initialized() and dist.get_world_size() > 1:
        statuses: list[str | None] = [None] * dist.get_world_size()
        local = None if error is None else f"{type(error).__name__}: {error}"
        dist.all_gather_object(statuses, local)
        failed = [(rank, status) for rank, status in enumerate(statuses) if status is not None]
    else:
        failed = [] if error is None else [(0, f"{type(error).__name__}: {error}")]
    if not failed:
        return
    causes = "; ".join(f"rank {rank}: {status}" for rank, status in failed)
    if error is not None:
        error.add_note(f"backward aborted on every rank, accumulators unchanged ({causes})")
        raise error
    raise GradientTransactionError(f"backward aborted, accumulators unchanged — {causes}")
