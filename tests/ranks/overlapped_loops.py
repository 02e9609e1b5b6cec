"""SPMD SFT whose last backward of each step sends its gradients while it runs (`trainer_core/ranks/fold_buckets.py`).

The loop `steps.train_step` runs, written out so each scenario can bend it:
two micro-batches per logical rank, a backward after the marked one or its
gradient edited in place after it (what the hooks sent is then stale), a marked backward that fails on one logical rank
after some buckets left (the step's work is cleared and run again, as a
caller retrying it would). At W = 1 there is nothing to overlap, so the W = 1
run of the same loop is the plain fold's: the tests compare bitwise.
"""

from __future__ import annotations

import contextlib

import torch

from trainer_core.ranks import LogicalDataParallel

FAILING_LOGICAL_RANK = 1
FAILING_STEP = 1


class InjectedFailure(RuntimeError):
    pass


def _loss_sum(trainer, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    out = trainer.forward(rows["input_ids"], rows["attention_mask"])
    return -(out.logprobs * rows["loss_mask"][:, 1:]).sum()


@contextlib.contextmanager
def _failing_late(trainer):
    """The marked backward fails when it reaches the embedding, after the layers' buckets have left."""
    embedding = trainer.model.get_input_embeddings().weight

    def fail(_grad):
        raise InjectedFailure("the marked backward fails late")

    handle = embedding.register_hook(fail)
    try:
        yield
    finally:
        handle.remove()


def _work(ldp, trainer, batch, step, num_loss_tokens, *, micro: int, extra: bool, edit: bool, fail: bool) -> dict:
    local = ldp.topology.local_logical_ranks
    loss_sums = {}
    with ldp.overlapped_step():
        for shard in ldp.forward_batches(batch, step=step):
            with shard:
                if shard.empty:
                    continue
                num_rows = shard.num_rows
                pieces = [range(0, num_rows)] if micro == 1 or num_rows < 2 else [range(0, 1), range(1, num_rows)]
                total = torch.zeros((), dtype=torch.float64)
                for index, rows in enumerate(pieces):
                    micro_rows = {name: tensor[rows.start : rows.stop] for name, tensor in shard.rows.items()}
                    marked = shard.logical_rank == local[-1] and index == len(pieces) - 1
                    failing = fail and shard.logical_rank == FAILING_LOGICAL_RANK and marked
                    with ldp.final_backward() if marked else contextlib.nullcontext():
                        with _failing_late(trainer) if failing else contextlib.nullcontext():
                            loss_sum = _loss_sum(trainer, micro_rows)
                            trainer.backward(loss_sum / num_loss_tokens)
                    total += loss_sum.detach().double()
                    # After the marked backward of the last logical rank (at every W some process's last): a second
                    # look at the same rows, so what its hooks sent is stale.
                    if extra and marked and shard.logical_rank == ldp.topology.logical_dp - 1:
                        trainer.backward(_loss_sum(trainer, micro_rows) / (4 * num_loss_tokens))
                    if edit and marked and shard.logical_rank == ldp.topology.logical_dp - 1:
                        for param in trainer.model.parameters():  # its accumulator halved in place after the hooks
                            if param.grad is not None:
                                param.grad.mul_(0.5)
                loss_sums[shard.logical_rank] = total
    return loss_sums


def spmd_overlapped(
    trainer, topology, batches, *, micro: int = 1, extra: bool = False, edit: bool = False, fail: bool = False
):
    """Per-step losses; with `fail`, step FAILING_STEP's first try fails in logical rank 1's marked backward."""
    ldp = LogicalDataParallel(trainer, topology, seed=0)
    losses = []
    for step, batch in enumerate(batches):
        num_loss_tokens = int(batch["loss_mask"][:, 1:].sum())
        try:
            loss_sums = _work(
                ldp,
                trainer,
                batch,
                step,
                num_loss_tokens,
                micro=micro,
                extra=extra,
                edit=edit,
                fail=fail and step == FAILING_STEP,
            )
        except Exception as error:  # every process fails alike (the logical rank's command exchanged it)
            assert step == FAILING_STEP and "fails late" in str(error), error
            trainer.zero_grad()
            loss_sums = _work(
                ldp, trainer, batch, step, num_loss_tokens, micro=micro, extra=extra, edit=edit, fail=False
            )
        losses.append(float(ldp.reduce(loss_sums, "sum")) / num_loss_tokens)
        ldp.step()
    return losses, dict(getattr(ldp.gradients, "overlap_counts", {}))
