"""Run under torchrun by test_distributed_optimizer: step semantics that every rank must agree on."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from tests.trainer.models import batch, tiny_qwen3
from tests.trainer.test_backward_state import sft_loss
from tests.trainer.test_optimizer_step import DetachedHead
from trainer_core.run.distributed import init_distributed, log, run_rank_process
from trainer_core.training import OptimizerConfig, Trainer


def digest(module: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in module.parameters())).hexdigest()


def same_on_every_rank(module: torch.nn.Module) -> bool:
    digests: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest(module))
    return len(set(digests)) == 1


def snapshot(module):
    return [p.detach().clone() for p in module.parameters()]


def main() -> None:
    topology = init_distributed(logical_dp=2, timeout_s=60)
    rank = topology.rank
    config = OptimizerConfig(learning_rate=1e-2, weight_decay=0.1, grad_clip=0.0)
    torch.manual_seed(0)
    head = DetachedHead()
    trainer = Trainer(tiny_qwen3().train())
    trainer.add_base_checkpoint(optimizer=config)
    trainer.add_module_checkpoint("value", head, optimizer=config)
    ids, mask = batch(seed=rank)

    def train_step(use_head: bool, extra=None):
        out = trainer.forward(ids, mask, outputs=("logprobs", "heads"))
        loss = sft_loss(out.logprobs, mask) + (out.heads["value"].pow(2).mean() if use_head else 0)
        trainer.backward(loss + (extra() if extra else 0))
        return trainer.step()

    assert same_on_every_rank(head) and same_on_every_rank(trainer.model), "ranks start apart"
    train_step(use_head=True)  # the head now has AdamW momentum
    before = snapshot(head)
    reports = train_step(use_head=False)  # no rank has a head gradient: no rank steps it
    assert not reports["value"].stepped and reports["value"].skipped_reason == "no gradient", reports
    assert all(torch.equal(p, q) for p, q in zip(head.parameters(), before)), "the head moved without a gradient"
    log(f"OK rank {rank} no-gradient checkpoint did not step")

    reports = train_step(use_head=rank == 0)  # only rank 0 has one: every rank steps it, identically
    assert reports["value"].stepped, reports
    assert same_on_every_rank(head), "head"
    assert same_on_every_rank(trainer.model), "model"
    log(f"OK rank {rank} one-rank gradient stepped on every rank")

    weight = head.proj.weight.detach().clone()
    reports = train_step(use_head=False, extra=(lambda: head.proj.bias.sum()) if rank == 1 else None)
    assert reports["value"].stepped and torch.equal(head.proj.weight, weight), "a parameter without gradient moved"
    assert same_on_every_rank(head)
    log(f"OK rank {rank} parameter without gradient on any rank left alone")

    for mismatch, kwargs in [
        ("learning_rate", {"learning_rate": 1e-3 * (rank + 1)}),
        ("checkpoints", {"names": ["base"] if rank == 0 else ["base", "value"]}),
    ]:
        out = trainer.forward(ids, mask, outputs=("logprobs", "heads"))
        trainer.backward(sft_loss(out.logprobs, mask) + out.heads["value"].pow(2).mean())
        weights = snapshot(trainer.model) + snapshot(head)
        try:
            trainer.step(**kwargs)
        except ValueError as error:
            assert f"differ in {mismatch}" in str(error) and "rank 0" in str(error) and "rank 1" in str(error), error
        else:
            raise AssertionError(f"step with a different {mismatch} per rank succeeded")
        assert all(
            torch.equal(p, q) for p, q in zip(list(trainer.model.parameters()) + list(head.parameters()), weights)
        )
        trainer.zero_grad()
        log(f"OK rank {rank} mismatched {mismatch} refused")


if __name__ == "__main__":
    run_rank_process(main)
