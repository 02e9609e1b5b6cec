"""How a trainer's gradients are combined over processes: the agreement at backward and the sum at step.

The default, `RankSum`, is plain data parallelism: every backward asks every
rank whether it succeeded (`transaction.ranks_agree`), each process
accumulates into `.grad`, and the step sums `.grad` over processes with one
all-reduce. `trainer_core.ranks` installs a logical-rank reduction instead
(`Trainer.gradient_reduction`), which keeps each logical rank's gradient
apart and folds them in logical order, so results do not depend on the
number of processes. `ShardedSum` is the reduction of a sharded model
(`Trainer(model, parallelism=FullyShard...)`): its engine's reduce-scatter SUM
already ran in backward, so the step only all-reduces what is not sharded (heads). Its
deterministic counterpart is `trainer_core.parallel.fsdp.gradients`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from ..parallel import is_distributed
from .checkpoints import Checkpoint
from .transaction import ranks_agree


class GradientReduction(Protocol):
    backward_is_collective: bool
    """Whether `agree_on_backward` talks to the other ranks (then a failed backward's graphs are kept for a retry)."""

    # Optional, read with getattr by the trainer: `for_sharded_model` (True: it reduces a sharded model's
    # gradients), `begin_forward(mode)` (called before a forward runs anything, with its backward mode, None under
    # no_grad; an error it raises fails that forward, nothing changed), `begin_backward()` (called before a
    # backward differentiates anything; an error it raises aborts that backward as any other), `canonical_norm` (True: the step's norm is `ranks.canonical_norm`;
    # both deterministic logical-rank reductions set it, `fast` and `RankSum` keep torch's float32 norm).

    def agree_on_backward(self, error: BaseException | None) -> BaseException | None:
        """The error this backward raises (None: publish its gradients), given this rank's own outcome."""

    def local_flags(self, checkpoints: Sequence[Checkpoint]) -> list[list[bool]]:
        """Per checkpoint, per parameter: whether this process holds a gradient for it."""
        ...

    def reduce(self, checkpoints: Sequence[Checkpoint], anywhere: Sequence[Sequence[bool]]) -> None:
        """Put the gradient summed over every rank on each optimized tensor whose flag is set anywhere."""

    def clear(self) -> None:
        """Drop every gradient held outside `.grad` (zero_grad)."""


class RankSum:
    """Each process's `.grad`, summed over processes with one all-reduce."""

    backward_is_collective = True

    def agree_on_backward(self, error: BaseException | None) -> BaseException | None:
        return ranks_agree(error)

    def local_flags(self, checkpoints: Sequence[Checkpoint]) -> list[list[bool]]:
        return [checkpoint.has_gradient() for checkpoint in checkpoints]

    def reduce(self, checkpoints: Sequence[Checkpoint], anywhere: Sequence[Sequence[bool]]) -> None:
        grads: list[torch.Tensor] = []
        for checkpoint, flags in zip(checkpoints, anywhere, strict=True):
            grads += checkpoint.gather_gradients(flags)
        all_reduce_sum_(grads)

    def clear(self) -> None:
        return None


class ShardedSum:
    """A sharded model's `fast` reduction: its engine's native reduce-scatter SUM, run inside every backward.

    Each rank's `.grad` of a sharded parameter is already its shard of the sum over ranks (the backward was a
    collective: `backward_is_collective`), so `reduce` adds nothing for them; parameters that are not sharded
    (a head registered with add_module_checkpoint, replicated on every rank) are summed as `RankSum` does.
    """

    backward_is_collective = True
    for_sharded_model = True

    def agree_on_backward(self, error: BaseException | None) -> BaseException | None:
        return ranks_agree(error)

    def local_flags(self, checkpoints: Sequence[Checkpoint]) -> list[list[bool]]:
        return [checkpoint.has_gradient() for checkpoint in checkpoints]

    def reduce(self, checkpoints: Sequence[Checkpoint], anywhere: Sequence[Sequence[bool]]) -> None:
        replicated: list[torch.Tensor] = []
        for checkpoint, flags in zip(checkpoints, anywhere, strict=True):
            replicated += [g for g in checkpoint.gather_gradients(flags) if not is_distributed(g)]
        all_reduce_sum_(replicated)

    def clear(self) -> None:
        return None


def all_reduce_sum_(tensors: list[torch.Tensor]) -> None:
    """Sum tensors over ranks in place, as one flat message."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
