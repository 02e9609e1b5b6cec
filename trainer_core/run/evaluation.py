"""The eval loss of the held-out rows, computed on every rank without touching training.

    eval_loss = evaluate(trainer, ldp, objective, eval_rows, revision=..., rows_per_forward=..., loss_tokens=...)

The held-out rows (`plan/eval.safetensors`, `trainer_core.run.held_out`) are split over the logical ranks as a
step's batch is (`Topology.logical_row_ranges`), each logical rank's rows run in forwards of `rows_per_forward`
rows (the training forward's rows; no activation is kept), each trimmed to its own longest row. Held-out rows
may be longer than the training rows: the pre-flight's memory check counts the longer (`validate_inputs`). A logical rank's loss sum is the float64 sum of its forwards' objective loss sums, in order; the
sums are reduced over logical ranks in logical order, so the eval loss is bitwise the same at any number of
processes where the training is (the deterministic reduction). Divided by the held-out loss tokens: the mean loss
per assistant token (SFT), or the objective's loss per loss token (RL), as a training step's loss is.

Why training is unchanged (tests/trainer/test_evaluation.py checks it bitwise): the forwards run under
`torch.no_grad()` (the trainer keeps no graph, no planner decision, no version), in `eval()` mode (no dropout draw),
inside a forked RNG, and every module's training mode is put back after; no gradient, optimizer state or buffer is
written. On a sharded model every process runs the same number of forwards (FSDP's all-gathers are collectives):
a logical rank with fewer rows runs throwaway forwards of one short row to keep in step.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..data.trim import trim_padding
from ..objectives import Objective
from ..ranks import LogicalDataParallel
from ..ranks.coordination import coordinated
from ..ranks.logical_dp import backward_is_collective
from ..ranks.rng import model_device
from ..training import Trainer
from .steps import micro_batches


def evaluate(
    trainer: Trainer,
    ldp: LogicalDataParallel,
    objective: Objective,
    rows: Mapping[str, torch.Tensor],
    *,
    revision: int,
    rows_per_forward: int,
    loss_tokens: int,
) -> float:
    """The held-out loss per loss token (NaN when the rows hold no loss token); the same on every rank."""
    objective = objective.for_evaluation()  # every held-out loss token counts (no staleness bound)
    num_rows = next(iter(rows.values())).shape[0]
    ranges = ldp.topology.logical_row_ranges(num_rows)
    lockstep = backward_is_collective(trainer)  # its forwards gather weights collectively too
    # Forwards per logical rank on a sharded model: the most any logical rank needs, so every process runs as many.
    in_step = max(-(-len(r) // rows_per_forward) for r in ranges) if lockstep else 0
    sums: dict[int, torch.Tensor] = {}
    model = trainer.model
    modes = [(module, module.training) for module in model.modules()]  # each module's own, put back as it was
    device = model_device(model)
    with (
        coordinated("evaluation", lockstep=lockstep),
        torch.no_grad(),
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
    ):
        model.eval()
        try:
            for logical_rank in ldp.topology.local_logical_ranks:
                span = ranges[logical_rank]
                own = {name: tensor[span.start : span.stop] for name, tensor in rows.items()}
                pieces = micro_batches(own, rows_per_forward) if len(span) else []
                total = torch.zeros((), dtype=torch.float64)
                for piece in pieces:
                    piece = trim_padding(piece)
                    out = trainer.forward(piece["input_ids"], piece["attention_mask"])
                    assert out.logprobs is not None  # the default outputs hold them
                    total += objective.loss_sum(out.logprobs, piece, revision=revision).loss.double().cpu()
                for _ in range(in_step - len(pieces)):
                    trainer.forward(rows["input_ids"][:1, :8], rows["attention_mask"][:1, :8])
                if pieces:
                    sums[logical_rank] = total
        finally:
            for module, training in modes:
                module.training = training
    total_loss = float(ldp.reduce(sums, "sum"))
    return total_loss / loss_tokens if loss_tokens else float("nan")
