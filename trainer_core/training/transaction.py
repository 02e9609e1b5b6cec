"""Transactional gradients: stage, validate, agree across ranks, then commit all at once.

Backward never writes into `.grad` while it runs. It stages every gradient,
validates the lot (shapes, dtypes, finiteness, that no checkpoint moved while
it ran), asks every rank whether it succeeded, and only then commits. Any
failure — an exception mid-backward, a rank that failed — leaves every
accumulator bitwise as it was.

The commit builds every new accumulator first and publishes them only then.
An accumulator is the caller's alone: dense, contiguous, with its own storage.
Autograd's gradients may be none of that — `p.sum()` gives a stride-0 expand,
`h @ (a + b)` gives `a` and `b` the very same tensor, an identity op hands back
the cotangent itself — and an accumulator sharing storage would be summed into
twice, or fail the next in-place add after some accumulators already changed.
A staged gradient is adopted as it is only when it provably has none of those
properties; otherwise it is copied.

Under sharding a gradient is distributed, this rank's shard of the sum over ranks
(its engine reduced it in backward). Every test here reads the local shard
only: no check may start a collective, because a rank that failed earlier
would not join it. The commit's add is elementwise on the shards.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
import torch.distributed as dist

from ..parallel import local_tensor
from .checkpoints import Checkpoint
from .versions import Version

NonFinitePolicy = Literal["error", "skip"]


class GradientTransactionError(RuntimeError):
    """Backward was aborted; no accumulator changed. The message says which rank and why."""


def _owns_its_storage(tensor: torch.Tensor) -> bool:
    tensor = local_tensor(tensor)
    return (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


def new_accumulator(existing: torch.Tensor | None, staged: torch.Tensor, adopt: bool) -> torch.Tensor:
    """`existing + staged` in a tensor of its own (IEEE addition commutes: the same bits as adding in place)."""
    accumulator = staged if adopt else staged.clone(memory_format=torch.contiguous_format)
    if existing is not None:
        accumulator.add_(existing)
    return accumulator


class StagedGradients:
    def __init__(self, checkpoints: dict[str, Checkpoint], foreign: Iterable[torch.Tensor] = ()):
        self._checkpoints = checkpoints
        self._versions: dict[str, Version] = {name: c.version for name, c in checkpoints.items()}
        self._grads: dict[tuple[str, str], torch.Tensor] = {}
        self._summed: set[tuple[str, str]] = set()
        self._built: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Storages a gradient may alias but that are not ours to keep (the caller's `gradient=`, cotangents).
        self._foreign = {local_tensor(t).untyped_storage().data_ptr() for t in foreign}

    def __len__(self) -> int:
        return len(self._grads)

    def add(self, checkpoint: str, param: str, grad: torch.Tensor) -> None:
        key = (checkpoint, param)
        current = self._grads.get(key)
        if current is None:
            self._grads[key] = grad
        else:
            self._grads[key] = current + grad
            self._summed.add(key)

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
            local = [(p, local_tensor(g)) for p, g in items]
            if nonfinite == "error" and not bool(torch.stack([g.sum() for _, g in local]).isfinite().all()):
                culprit = next((p for p, g in local if not bool(torch.isfinite(g).all())), None)
                if culprit is None:
                    continue
                raise GradientTransactionError(
                    f"checkpoint '{checkpoint}' parameter {culprit}: non-finite gradient; fix the loss, or construct the "
                    "trainer with nonfinite='skip' to let the optimizer step skip the update"
                )

    def _adoptable(self) -> set[tuple[str, str]]:
        """Staged gradients that can become accumulators as they are: sums we made, or autograd's own dense tensors
        that share their storage with nothing else staged and with nothing the caller holds."""
        adoptable, storages = set(self._summed), {}
        for key, grad in self._grads.items():
            if key in self._summed:
                continue
            storage = local_tensor(grad).untyped_storage().data_ptr()
            storages[storage] = storages.get(storage, 0) + 1
        for key, grad in self._grads.items():
            storage = local_tensor(grad).untyped_storage().data_ptr()
            if (
                key not in self._summed
                and storages[storage] == 1
                and storage not in self._foreign
                and _owns_its_storage(grad)
            ):
                adoptable.add(key)
        return adoptable

    def build(self) -> None:
        """Build every new accumulator (nothing is published yet): runs before the ranks agree, so a failure here
        — out of memory — aborts the transaction on every rank."""
        adoptable = self._adoptable()
        self._built = []
        with torch.no_grad():
            for checkpoint, live, items in self._by_checkpoint():
                for param, grad in items:
                    target = live[param]
                    adopt = (checkpoint, param) in adoptable
                    self._built.append((target, new_accumulator(target.grad, grad.detach(), adopt)))

    def publish(self) -> None:
        """Make every built accumulator the parameter's `.grad`; if one assignment fails, every one is restored."""
        previous = [(target, target.grad) for target, _ in self._built]
        try:
            for target, accumulator in self._built:
                target.grad = accumulator
        except BaseException:
            for target, grad in previous:
                target.grad = grad
            raise
        finally:
            self._built = []
            self._grads.clear()

    def commit(self) -> None:
        self.build()
        self.publish()


def ranks_agree(error: BaseException | None) -> BaseException | None:
    """Whether every rank succeeded; otherwise the error to raise on this rank, naming the failing ranks.

    A rank that failed gets its own error back (its type tells the caller what
    went wrong); the others get a GradientTransactionError naming it. Every
    rank takes part, so none hangs waiting for another.
    """
    if dist.is_initialized() and dist.get_world_size() > 1:
        statuses: list[str | None] = [None] * dist.get_world_size()
        local = None if error is None else f"{type(error).__name__}: {error}"
        dist.all_gather_object(statuses, local)
        failed = [(rank, status) for rank, status in enumerate(statuses) if status is not None]
    else:
        failed = [] if error is None else [(0, f"{type(error).__name__}: {error}")]
    if not failed:
        return None
    causes = "; ".join(f"rank {rank}: {status}" for rank, status in failed)
    if error is not None:
        error.add_note(f"backward aborted on every rank, accumulators unchanged ({causes})")
        return error
    return GradientTransactionError(f"backward aborted, accumulators unchanged — {causes}")
