"""Run under torchrun by test_sharded_logical_ranks: deterministic logical ranks (logical_dp = 4) on a sharded Trainer.

Every scenario trains three steps through the logical-DP facade (the third
step's batch has 3 rows for 4 logical ranks: one logical rank is empty) and
prints one RESULT line per rank (tests/trainer/sharded_ranks.py) with a
digest of every loss, every whole weight and every whole AdamW moment. The
test compares the digests across W = 1, 2, 4 and with the unsharded
trainer's deterministic run of the same scenario (W = 1 launch; clipped at
W = 1 and 2, replicated over the launch's processes).
"""

from __future__ import annotations

import copy
import hashlib

import torch

from tests.trainer.models import batch, tiny_qwen3
from tests.trainer.sharded_ranks import VOCAB, bitwise, emit, full, start
from trainer_core.parallel import FullyShard, local_tensor
from trainer_core.parallel.fsdp.shard import shard_model
from trainer_core.ranks import LogicalDataParallel, Topology
from trainer_core.run.distributed import run_rank_process
from trainer_core.training import Trainer
from trainer_core.training.checkpoints import OptimizerConfig

LOGICAL_DP = 4
ROWS_PER_STEP = (4, 8, 3)  # 3 rows for 4 logical ranks: logical rank 3 is empty at the last step
OPTIMIZER = OptimizerConfig(learning_rate=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=0.0)
CLIPPED = OptimizerConfig(learning_rate=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=0.05)


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(full(tensor).detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def state_digests(trainer) -> dict[str, str]:
    """One digest of every whole weight, one of every whole AdamW moment (a RESULT line must stay short)."""
    checkpoints = list(trainer.checkpoints.values())
    weights = [digest(p) for checkpoint in checkpoints for p in checkpoint.parameters().values()]
    moments = [
        digest(checkpoint.optimizer.state[p][key])
        for checkpoint in checkpoints
        for p in checkpoint.optimized_parameters().values()
        for key in ("exp_avg", "exp_avg_sq")
    ]
    return {
        "weights": hashlib.sha256("".join(weights).encode()).hexdigest(),
        "moments": hashlib.sha256("".join(moments).encode()).hexdigest(),
    }


class FaultOnce:
    """Make this process's backward fail after autograd ran (its gradients staged), once, at one logical rank."""

    def __init__(self, trainer, logical_rank: int | None):
        self.trainer, self.logical_rank, self.fired = trainer, logical_rank, False
        self._stage = trainer._stage

    def install(self, ldp) -> None:
        def stage(*args, **kwargs):
            result = self._stage(*args, **kwargs)
            if not self.fired and ldp.gradients.active == self.logical_rank:
                self.fired = True
                raise RuntimeError("injected fault after backward")
            return result

        self.trainer._stage = stage


def train(
    rank, world_size, mesh, *, sharded: bool, optimizer=OPTIMIZER, fault: bool = False, head: bool = False
) -> dict:
    """`head`: a value head (replicated, unsharded: its logical ranks' partials folded at the step) in the loss."""
    master = tiny_qwen3(vocab=VOCAB)
    torch.manual_seed(3)
    value_head = torch.nn.Linear(master.config.hidden_size, 1)
    model = copy.deepcopy(master)
    if sharded:
        trainer = Trainer(model, parallelism=FullyShard(shard_model(model, mesh)))
        topology = Topology(rank, world_size, LOGICAL_DP)
    else:  # replicated on every process: the unsharded deterministic reduction (LogicalGradients)
        trainer, topology = Trainer(model), Topology(rank, world_size, LOGICAL_DP)
    trainer.add_base_checkpoint(optimizer=optimizer)
    if head:
        trainer.add_module_checkpoint("value", value_head, optimizer=optimizer)
    outputs = ("logprobs", "heads") if head else ("logprobs",)
    ldp = LogicalDataParallel(trainer, topology, seed=7)
    local = list(ldp.topology.local_logical_ranks)
    # The fault: on the last process, at its last logical rank of the first step (after a committed turn at W < 4).
    injector = FaultOnce(trainer, local[-1] if fault and rank == world_size - 1 else None)
    injector.install(ldp)
    losses, norms, fault_result = [], [], {}
    for step, num_rows in enumerate(ROWS_PER_STEP):
        ids, mask = batch(seed=50 + step, size=num_rows, vocab=VOCAB)
        num_tokens = int(mask[:, 1:].sum())
        sums = {}
        for shard in ldp.forward_batches({"input_ids": ids, "attention_mask": mask}, step=step):
            with shard:
                if shard.empty:
                    continue  # the facade runs the dummy turn a sharded model needs
                out = trainer.forward(
                    shard.rows["input_ids"], shard.rows["attention_mask"], outputs=outputs, mode="retain"
                )
                assert out.logprobs is not None
                rows_mask = shard.rows["attention_mask"][:, 1:]

                def loss_of(out, rows_mask=rows_mask):
                    loss_sum = -(out.logprobs * rows_mask).sum()
                    return loss_sum + out.heads["value"].pow(2).sum() / 100 if head else loss_sum

                loss_sum = loss_of(out)
                if fault and step == 0 and shard.logical_rank == local[-1]:
                    before = [None if p.grad is None else local_tensor(p.grad).clone() for p in _params(trainer)]
                    try:
                        trainer.backward(loss_sum / num_tokens)
                        raised = None
                    except Exception as error:  # noqa: BLE001 - the check reports what was raised
                        raised = type(error).__name__
                    after = [None if p.grad is None else local_tensor(p.grad) for p in _params(trainer)]
                    fault_result = {
                        "raised": raised,
                        "unchanged": all(
                            (a is None and b is None) or (a is not None and b is not None and bitwise(a, b))
                            for a, b in zip(before, after, strict=True)
                        ),
                        "committed_before": sum(g is not None for g in before),
                    }
                    if world_size == 1:  # alone, autograd freed the graph as it went (no peer could fail): again
                        out = trainer.forward(shard.rows["input_ids"], shard.rows["attention_mask"], mode="retain")
                # The retry (the forward's graph was kept; the loss is built again), or the only backward.
                trainer.backward(loss_of(out) / num_tokens)
                sums[shard.logical_rank] = loss_sum.detach()
        losses.append(float(ldp.reduce(sums, "sum") / num_tokens).hex())
        reports = ldp.step()
        report = reports["base"]
        assert all(r.stepped for r in reports.values()), reports
        norms.append(float(report.grad_norm).hex())
        assert report.stepped, report
    return {"losses": losses, "norms": norms, "state": state_digests(trainer), "fault": fault_result}


def check_second_backward(rank, world_size, mesh) -> None:
    """A second backward inside one logical rank's block is refused on every process; the first one stays."""
    model = tiny_qwen3(vocab=VOCAB)
    trainer = Trainer(model, parallelism=FullyShard(shard_model(model, mesh)))
    trainer.add_base_checkpoint(optimizer=OPTIMIZER)
    ldp = LogicalDataParallel(trainer, Topology(rank, world_size, LOGICAL_DP), seed=7)
    ids, mask = batch(seed=50, size=4, vocab=VOCAB)
    messages, kept = [], []
    for shard in ldp.forward_batches({"input_ids": ids, "attention_mask": mask}, step=0):
        with shard:
            out = trainer.forward(shard.rows["input_ids"], shard.rows["attention_mask"], mode="retain")
            assert out.logprobs is not None
            trainer.backward(out.logprobs.sum(), retain_graph=True)
            first = [local_tensor(p.grad).clone() for p in _params(trainer) if p.grad is not None]
            try:
                trainer.backward(out.logprobs.sum())
                messages.append(None)
            except ValueError as error:
                messages.append(str(error))
            after = [local_tensor(p.grad) for p in _params(trainer) if p.grad is not None]
            kept.append(len(first) == len(after) > 0 and all(bitwise(a, b) for a, b in zip(first, after)))
    emit("second_backward", rank, messages=messages, kept=kept)


EMPTY_STEP_ROWS = 3  # for 4 logical ranks: logical rank 3 is empty, a dummy turn at W > 1 (none at W = 1)


def one_step_with_an_empty_rank(trainer, ldp, mode: str) -> str:
    """One step's blocks over 3 rows (logical rank 3 empty; its block skipped), every forward in `mode`; the loss."""
    ids, mask = batch(seed=52, size=EMPTY_STEP_ROWS, vocab=VOCAB)
    num_tokens = int(mask[:, 1:].sum())
    sums = {}
    for shard in ldp.forward_batches({"input_ids": ids, "attention_mask": mask}, step=0):
        with shard:
            if shard.empty:
                continue
            out = trainer.forward(shard.rows["input_ids"], shard.rows["attention_mask"], mode=mode)
            assert out.logprobs is not None
            loss_sum = -(out.logprobs * shard.rows["attention_mask"][:, 1:]).sum()
            trainer.backward(loss_sum / num_tokens)
            sums[shard.logical_rank] = loss_sum.detach()
    return float(ldp.reduce(sums, "sum") / num_tokens).hex()


def check_empty_rank_rng(rank, world_size, mesh) -> None:
    """Dropout on, a step with an empty logical rank: the caller's RNG after the step draws what it draws at W = 1
    (at W > 1 the empty rank's dummy forward runs its dropout; it must not draw from the caller's streams)."""
    model = tiny_qwen3(vocab=VOCAB, dropout=0.1)
    trainer = Trainer(model, parallelism=FullyShard(shard_model(model, mesh)))
    trainer.add_base_checkpoint(optimizer=OPTIMIZER)
    ldp = LogicalDataParallel(trainer, Topology(rank, world_size, LOGICAL_DP), seed=7)
    torch.manual_seed(11)  # the caller's streams, the same on every process and at every W
    loss = one_step_with_an_empty_rank(trainer, ldp, "retain")
    ldp.step()
    emit("empty_rank_rng", rank, perm=torch.randperm(8).tolist(), loss=loss, state=state_digests(trainer))


def check_replay_beside_empty(rank, world_size, mesh) -> None:
    """Replay in the real blocks beside an empty logical rank (its dummy in empty_mode 'retain'): at W > 1 refused
    on every process before any collective of the turn (then the processes are still in step: a retain step
    follows, bitwise the same at every W); at W = 1 no dummy runs, so it trains."""
    model = tiny_qwen3(vocab=VOCAB)
    trainer = Trainer(model, parallelism=FullyShard(shard_model(model, mesh)))
    trainer.add_base_checkpoint(optimizer=OPTIMIZER)
    ldp = LogicalDataParallel(trainer, Topology(rank, world_size, LOGICAL_DP), seed=7)
    try:
        one_step_with_an_empty_rank(trainer, ldp, "replay")
        refused = None
    except ValueError as error:
        refused = str(error)
    trainer.zero_grad()
    loss = one_step_with_an_empty_rank(trainer, ldp, "retain")
    ldp.step()
    emit("replay_beside_empty", rank, refused=refused, loss=loss, state=state_digests(trainer))


def _params(trainer) -> list[torch.Tensor]:
    return list(trainer.checkpoints["base"].parameters().values())


def main() -> None:
    rank, world_size, mesh = start()
    emit("sharded", rank, **train(rank, world_size, mesh, sharded=True))
    emit("sharded_clipped", rank, **train(rank, world_size, mesh, sharded=True, optimizer=CLIPPED))
    emit("sharded_fault", rank, **train(rank, world_size, mesh, sharded=True, fault=True))
    check_second_backward(rank, world_size, mesh)
    check_empty_rank_rng(rank, world_size, mesh)
    check_replay_beside_empty(rank, world_size, mesh)
    emit("sharded_head", rank, **train(rank, world_size, mesh, sharded=True, head=True))
    if world_size == 1:
        emit("unsharded", rank, **train(rank, world_size, mesh, sharded=False))
        emit("unsharded_head", rank, **train(rank, world_size, mesh, sharded=False, head=True))
    if world_size <= 2:  # clipped: both deterministic reductions take canonical_norm, so they agree to the bit
        emit("unsharded_clipped", rank, **train(rank, world_size, mesh, sharded=False, optimizer=CLIPPED))


if __name__ == "__main__":
    run_rank_process(main)
