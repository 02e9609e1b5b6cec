"""Training loops over logical ranks, run in-process at W = 1 and by torchrun workers at W = 2 and 4.

Every loop returns its per-step losses; `digest` names the final weights. The
tests compare both bitwise across world sizes, and against a plain `Trainer`
on the whole global batch within float tolerance (an independent reference).
"""

from __future__ import annotations

import hashlib

import torch

from tests.trainer.models import tiny_qwen3
from trainer_core.ranks import LogicalDataParallel
from trainer_core.training import OptimizerConfig, Trainer

LOGICAL_DP = 4
VOCAB = 97
SEQ_LEN = 12
EVEN_ROWS = (8, 8, 8)
UNEVEN_ROWS = (8, 3, 2, 6)
"""At L = 4: 3 rows leave logical rank 3 empty, 2 rows leave ranks 2 and 3 empty (at W = 4: whole processes)."""
RL_ROWS = (8, 6, 3, 8)


def digest(trainer) -> str:
    return hashlib.sha256(
        b"".join(
            p.detach().contiguous().numpy().tobytes()
            for c in trainer.checkpoints.values()
            for p in c.parameters().values()
        )
    ).hexdigest()


def make_trainer(*, dropout: float = 0.1) -> Trainer:
    trainer = Trainer(tiny_qwen3(seed=0, dropout=dropout).train())
    trainer.add_base_checkpoint(optimizer=OptimizerConfig(learning_rate=1e-2, grad_clip=1.0))
    return trainer


def sft_batches(rows: tuple[int, ...], seed: int = 1) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for num_rows in rows:
        input_ids = torch.randint(3, VOCAB, (num_rows, SEQ_LEN), generator=generator)
        lengths = torch.randint(SEQ_LEN // 2, SEQ_LEN + 1, (num_rows,), generator=generator)
        attention_mask = (torch.arange(SEQ_LEN)[None, :] < lengths[:, None]).long()
        loss_mask = attention_mask.bool() & (torch.arange(SEQ_LEN)[None, :] >= 2)
        batches.append({"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask})
    return batches


def rl_batches(rows: tuple[int, ...] = RL_ROWS, seed: int = 2) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for batch in sft_batches(rows, seed):
        num_rows = batch["input_ids"].shape[0]
        batch["behaviour_logprobs"] = -4.6 + 0.3 * torch.randn(num_rows, SEQ_LEN - 1, generator=generator)
        batch["advantages"] = torch.randn(num_rows, 1, generator=generator).expand(num_rows, SEQ_LEN - 1).contiguous()
        batches.append(batch)
    return batches


def spmd_sft(trainer, topology, batches, *, reduction: str = "deterministic", yield_empty: bool = True) -> list[float]:
    """SPMD code over the logical-DP facade: each process works on its logical ranks' shards."""
    ldp = LogicalDataParallel(trainer, topology, reduction=reduction, seed=0)
    losses = []
    for step, batch in enumerate(batches):
        num_loss_tokens = int(batch["loss_mask"][:, 1:].sum())
        loss_sums = {}
        for shard in ldp.forward_batches(batch, step=step, yield_empty=yield_empty):
            with shard:
                if shard.empty:
                    continue
                out = trainer.forward(shard.rows["input_ids"], shard.rows["attention_mask"])
                loss_sum = -(out.logprobs * shard.rows["loss_mask"][:, 1:]).sum()
                trainer.backward(loss_sum / num_loss_tokens)
                loss_sums[shard.logical_rank] = loss_sum.detach()
        losses.append(float(ldp.reduce(loss_sums, "sum")) / num_loss_tokens)
        ldp.step()
    return losses


def sft_loop(trainer, batches) -> list[float]:
    """Written for one process: the whole global batch in one forward."""
    losses = []
    for batch in batches:
        out = trainer.forward(batch["input_ids"], batch["attention_mask"])
        mask = batch["loss_mask"][:, 1:]
        loss = -(out.logprobs * mask).sum() / mask.sum()
        trainer.backward(loss)
        trainer.step()
        losses.append(loss.item())
    return losses


def rl_loop(trainer, batches) -> list[float]:
    """Off-policy RL written for one process: the next batch's forward runs before this step (one step stale)."""
    losses = []
    out = trainer.forward(batches[0]["input_ids"], batches[0]["attention_mask"])
    for index, batch in enumerate(batches):
        upcoming = (
            trainer.forward(batches[index + 1]["input_ids"], batches[index + 1]["attention_mask"])
            if index + 1 < len(batches)
            else None
        )
        mask = batch["loss_mask"][:, 1:].to(out.logprobs.dtype)
        ratio = torch.exp(out.logprobs - batch["behaviour_logprobs"])
        advantages = batch["advantages"]
        surrogate = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.28) * advantages)
        loss = (surrogate * mask).sum() / mask.sum()
        trainer.backward(loss)
        trainer.step()
        losses.append(loss.item())
        out = upcoming
    return losses


SHUFFLE_POOL_ROWS = 16
SHUFFLE_BATCH_ROWS = 6
SHUFFLE_STEPS = 3
SHUFFLE_SEED = 1234


def shuffle_pool(seed: int = 3) -> dict[str, torch.Tensor]:
    """The rows a shuffling loop draws its batches from."""
    return sft_batches((SHUFFLE_POOL_ROWS,), seed)[0]


def _rows(pool: dict[str, torch.Tensor], order: torch.Tensor) -> dict[str, torch.Tensor]:
    return {name: tensor[order] for name, tensor in pool.items()}


def spmd_shuffled(trainer, topology, pool) -> list[float]:
    """SPMD SFT whose every next batch is a `torch.randperm` of the pool, drawn from the global RNG after the forwards.

    Every process draws the same order only if the facade left each process's
    global RNG as the caller had it (a facade that reseeds leaves it at the
    seed of the last logical rank the process ran: a different one per W and
    per process).
    """
    ldp = LogicalDataParallel(trainer, topology, seed=0)
    losses = []
    with torch.random.fork_rng(devices=[]):  # the caller's own seed, without changing the test process's stream
        torch.manual_seed(SHUFFLE_SEED)
        order = torch.randperm(SHUFFLE_POOL_ROWS)[:SHUFFLE_BATCH_ROWS]
        for step in range(SHUFFLE_STEPS):
            batch = _rows(pool, order)
            num_loss_tokens = int(batch["loss_mask"][:, 1:].sum())
            loss_sums = {}
            for shard in ldp.forward_batches(batch, step=step):
                with shard:
                    out = trainer.forward(shard.rows["input_ids"], shard.rows["attention_mask"])
                    loss_sum = -(out.logprobs * shard.rows["loss_mask"][:, 1:]).sum()
                    trainer.backward(loss_sum / num_loss_tokens)
                    loss_sums[shard.logical_rank] = loss_sum.detach()
            order = torch.randperm(SHUFFLE_POOL_ROWS)[:SHUFFLE_BATCH_ROWS]  # after the forwards
            losses.append(float(ldp.reduce(loss_sums, "sum")) / num_loss_tokens)
            ldp.step()
    return losses


def rank_zero_shuffled(trainer, pool) -> list[float]:
    """Written for one process: after each forward, a token subsample and the next batch's order from the global RNG."""
    losses = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SHUFFLE_SEED)
        order = torch.randperm(SHUFFLE_POOL_ROWS)[:SHUFFLE_BATCH_ROWS]
        for _ in range(SHUFFLE_STEPS):
            batch = _rows(pool, order)
            out = trainer.forward(batch["input_ids"], batch["attention_mask"])
            keep = torch.rand(out.logprobs.shape) < 0.75  # drawn after the forward
            mask = batch["loss_mask"][:, 1:] & keep
            loss = -(out.logprobs * mask).sum() / mask.sum()
            trainer.backward(loss)
            order = torch.randperm(SHUFFLE_POOL_ROWS)[:SHUFFLE_BATCH_ROWS]  # after the backward, before the step
            trainer.step()
            losses.append(loss.item())
    return losses
