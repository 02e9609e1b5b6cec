"""One optimizer step of a segment: forwards and backwards over this rank's logical ranks, figures by name.

A logical rank's rows run as micro-batches of `train.micro_batch_size` rows
(all of them in one forward where it is unset): each a forward and a
backward, so only one micro-batch's activations are alive at a time, and the
logical rank's gradient is their sum (gradient accumulation). Each
micro-batch's rows are cut to their own longest row first
(`data.trim`: the plan pads unpacked rows to the segment's longest).
Shard tensors are aligned per target token t; `logprobs[:, t-1]` is the
logprob of target t (`trainer_core/data/shards.py`). Each logical rank's loss
sum comes from the objective, is divided by the loss tokens of the whole
global batch (the same loss at any split), and its figures are packed by the
segment's `FigureLayout` for the one ordered reduction over logical ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from trainer_core.run.distributed import log
from trainer_core.run.faults import maybe_inject_fault, nonfinite_loss_factor

from ..config import RunConfig
from ..data.pack import packed_attention_inputs
from ..data.trim import trim_padding
from ..objectives import Objective
from ..ranks import LogicalDataParallel
from ..training import Trainer
from .figures import FigureLayout


def _forward(trainer: Trainer, rows: dict[str, torch.Tensor], mode):
    if "position_ids" not in rows:
        return trainer.forward(rows["input_ids"], rows["attention_mask"], mode=mode)
    # Packed rows: no 2D attention mask (documents would see each other); the
    # model builds per-document causal attention from the restarting positions.
    packed = packed_attention_inputs(rows["input_ids"], rows["position_ids"], rows["document_ids"])
    return trainer.forward(
        packed["input_ids"], packed.get("attention_mask"), position_ids=packed["position_ids"], mode=mode
    )


def micro_batches(rows: dict[str, torch.Tensor], size: int | None) -> list[dict[str, torch.Tensor]]:
    """`rows` in consecutive pieces of `size` rows (the last may be shorter); all in one where `size` is unset."""
    num_rows = next(iter(rows.values())).shape[0]
    if size is None or size >= num_rows:
        return [rows]
    return [{name: tensor[start : start + size] for name, tensor in rows.items()} for start in range(0, num_rows, size)]


def logical_rank_work(
    objective: Objective,
    layout: FigureLayout,
    trainer: Trainer,
    rows: dict[str, torch.Tensor],
    *,
    step: int,
    rank: int,
    revision: int,
    num_loss_tokens: int,
    mode,
    micro_batch_size: int | None = None,
    last_backward: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> torch.Tensor:
    """Forwards and backwards of one logical rank's rows, micro-batch by micro-batch; returns its figures (summed
    over the micro-batches, in order), packed by `layout`. `last_backward`: the block the last micro-batch runs in
    when it is this process's last backward before the step (`LogicalDataParallel.final_backward`)."""
    micros = micro_batches(rows, micro_batch_size)
    figures = []
    for index, micro in enumerate(micros):
        last = index == len(micros) - 1
        with last_backward() if last_backward is not None and last else contextlib.nullcontext():
            figures.append(
                _micro_batch_work(objective, layout, trainer, micro, step, rank, revision, num_loss_tokens, mode)
            )
    return torch.stack(figures).sum(dim=0) if len(figures) > 1 else figures[0]


def _micro_batch_work(
    objective: Objective,
    layout: FigureLayout,
    trainer: Trainer,
    rows: dict[str, torch.Tensor],
    step: int,
    rank: int,
    revision: int,
    num_loss_tokens: int,
    mode,
) -> torch.Tensor:
    rows = trim_padding(rows)  # its own longest row, not the segment's (unpacked rows; packed ones as planned)
    out = _forward(trainer, rows, mode)
    assert out.logprobs is not None  # the forward's default outputs hold them
    part = objective.loss_sum(out.logprobs, rows, revision=revision)
    micro_loss = part.loss * nonfinite_loss_factor(step, rank)
    # Normalised by the loss tokens of the whole global batch: the same loss at any split.
    trainer.backward(micro_loss / num_loss_tokens)
    return layout.pack(
        {
            "loss_sum": micro_loss.detach().double(),
            "input_tokens": float(rows["attention_mask"].sum()),
            "token_slots": float(rows["input_ids"].numel()),
            "stale_trajectories": float(part.num_dropped),
            **part.figures,
        }
    )


def train_step(
    ldp: LogicalDataParallel,
    objective: Objective,
    layout: FigureLayout,
    batch: dict[str, torch.Tensor],
    step: int,
    revision: int,
    mode,
    micro_batch_size: int | None = None,
) -> dict[str, float]:
    """One optimizer step's forwards and backwards over this rank's logical ranks; returns the global figures."""
    num_loss_tokens = int(batch["loss_mask"][:, 1:].sum())
    rank = ldp.topology.rank
    figures: dict[int, torch.Tensor] = {}
    local = ldp.topology.local_logical_ranks
    # The last backward's gradients leave while it runs (the fold overlapped with it, as DDP's all-reduce).
    with ldp.overlapped_step():
        for shard in ldp.forward_batches(batch, step=step):
            with shard:  # one command: a failure here, on any rank, stops every rank with the rank named
                if shard.logical_rank == local[0]:
                    maybe_inject_fault(step, rank)
                if not shard.empty:
                    figures[shard.logical_rank] = logical_rank_work(
                        objective,
                        layout,
                        ldp.trainer,
                        shard.rows,
                        step=step,
                        rank=rank,
                        revision=revision,
                        num_loss_tokens=num_loss_tokens,
                        mode=mode,
                        micro_batch_size=micro_batch_size,
                        last_backward=ldp.final_backward if shard.logical_rank == local[-1] else None,
                    )
    return layout.unpack(ldp.reduce(figures, "sum"))


def step_figures(
    step: int, loss: float, report, learning_rate: float, sums: dict[str, float], step_s: float, objective: Objective
) -> dict[str, float | int | bool | None]:
    """One step's live figures (global: `sums` is already reduced over ranks), the objective's last."""
    tokens = sums["input_tokens"]
    figures: dict[str, float | int | bool | None] = {
        "step": step,
        "loss": loss,
        "grad_norm": float(report.grad_norm),
        "learning_rate": learning_rate,
        "stepped": bool(report.stepped),
        "tokens": int(tokens),
        "step_s": step_s,
        "tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
    }
    figures.update(objective.step_figures(sums))
    return figures


def note_skipped(config: RunConfig, step: int, report, skipped: list[int]) -> None:
    """Record a step whose update was skipped, or fail it as `train.nonfinite = "error"` asks."""
    if report.stepped:
        return
    if report.skipped_reason == "no gradient":
        skipped.append(step)
        log(f"step {step}: no gradient on any rank (every loss token masked); nothing to update")
        return
    # Every rank holds the same reduced norm, so every rank takes this branch alike.
    if config.train.nonfinite == "error":
        raise RuntimeError(
            f"step {step}: non-finite gradient norm {report.grad_norm} ({report.skipped_reason}); "
            "failing the segment as train.nonfinite = 'error' asks — set it to 'skip' to skip "
            "such updates instead"
        )
    skipped.append(step)
    log(f"step {step}: non-finite gradient norm {report.grad_norm}; update skipped on every rank")
