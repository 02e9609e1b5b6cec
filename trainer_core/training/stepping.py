"""The optimizer step over the selected checkpoints: agree across ranks, reduce, every norm first, then all or none.

1. Every rank says which checkpoints it steps, at which revision, with which
   learning rate and optimizer settings, and which parameters have a gradient
   (one all-gather). Terms that differ are an error on every rank, naming the
   ranks and what differs; a parameter's gradient counts if any rank has one.
2. The trainer's gradient reduction (`gradient_reduction.py`) puts the sum
   over ranks onto the optimized tensors (FP32 masters for low-precision
   parameters): by default each process's `.grad`, all-reduced as one message
   (a parameter with a gradient elsewhere counts zeros here); with logical
   ranks, every logical rank's gradient folded in logical order. A parameter
   with no gradient anywhere stays without (AdamW leaves it alone, as torch's does).
3. Every checkpoint's norm is computed. If any is non-finite, no checkpoint
   steps — on any rank, since all hold the same sums — and every report says
   which. A checkpoint without a gradient does not step ("no gradient").
4. The others clip with their own norm and take one AdamW step each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import astuple

import torch.distributed as dist

from .checkpoints import Checkpoint, StepReport, nonfinite_reason
from .gradient_reduction import GradientReduction, RankSum

_TERM_FIELDS = ("checkpoints", "revision", "learning_rate", "optimizer settings")


def _terms(rates: dict[str, float], checkpoints: Sequence[Checkpoint]) -> tuple[tuple, ...]:
    names = tuple(c.name for c in checkpoints)
    return (
        names,
        tuple(c.revision for c in checkpoints),
        tuple(rates[c.name] for c in checkpoints),
        tuple(astuple(c.optimizer_config) for c in checkpoints),
    )


def agree_on_step(terms: tuple[tuple, ...], has_gradient: list[bool]) -> list[bool]:
    """Check that every rank steps alike; returns, per parameter, whether any rank has a gradient."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return has_gradient
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (terms, has_gradient))
    differing = [field for index, field in enumerate(_TERM_FIELDS) if len({g[0][index] for g in gathered}) > 1]
    if differing:
        per_rank = "; ".join(
            f"rank {rank}: checkpoints {list(t[0])}, revisions {list(t[1])}, learning_rate {list(t[2])}"
            for rank, (t, _) in enumerate(gathered)
        )
        raise ValueError(
            f"step() differs across ranks — they differ in {', '.join(differing)} ({per_rank}); every rank must "
            "step the same checkpoints with the same learning rate and settings; nothing was stepped"
        )
    return [any(flags) for flags in zip(*(g[1] for g in gathered), strict=True)]


def step_checkpoints(
    checkpoints: Sequence[Checkpoint],
    learning_rate: float | None,
    before_update: Callable[[Checkpoint], None],
    reduction: GradientReduction | None = None,
    schedule_step: int | None = None,
) -> dict[str, StepReport]:
    """Step the checkpoints together; `before_update` runs on each one just before its weights change.

    Each checkpoint's rate is `Checkpoint.learning_rate(learning_rate, schedule_step)`: its own schedule where it
    has one, else `learning_rate`, else its optimizer's rate."""
    reduction = reduction or RankSum()
    for checkpoint in checkpoints:  # a restore's moments still being read: loaded (or refused) before any update
        checkpoint.finish_restore()
    rates = {c.name: c.learning_rate(learning_rate, schedule_step) for c in checkpoints}
    flags = reduction.local_flags(checkpoints)
    anywhere = agree_on_step(_terms(rates, checkpoints), [f for per in flags for f in per])
    per_checkpoint, offset = [], 0
    for local in flags:
        per_checkpoint.append(anywhere[offset : offset + len(local)])
        offset += len(local)
    reduction.reduce(checkpoints, per_checkpoint)
    canonical = bool(getattr(reduction, "canonical_norm", False))  # a reduction may fix the norm's bits too
    norms = {c.name: c.gradient_norm(canonical=canonical) for c in checkpoints}
    values = {name: float(norm) if norm is not None else 0.0 for name, norm in norms.items()}
    reason = nonfinite_reason(values)
    reports = {}
    for checkpoint in checkpoints:
        name, norm = checkpoint.name, norms[checkpoint.name]
        if reason is not None or norm is None:
            checkpoint.clear_gradients()
            reports[name] = StepReport(
                name, False, values[name], checkpoint.version, reason or "no gradient", learning_rate=rates[name]
            )
            continue
        before_update(checkpoint)
        checkpoint.apply(norm, rates[name])
        reports[name] = StepReport(name, True, values[name], checkpoint.version, learning_rate=rates[name])
    return reports
