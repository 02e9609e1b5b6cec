"""Run under torchrun by test_distributed_transaction: rank 1 fails mid-backward, then both ranks retry it."""

from __future__ import annotations

import torch

from tests.trainer.models import batch, tiny_qwen3
from tests.trainer.test_backward_state import reference_logprobs, sft_loss
from trainer_core.run.distributed import init_distributed, log, run_rank_process
from trainer_core.training import GradientTransactionError, Trainer


def reference_grads(ids, mask) -> list[torch.Tensor]:
    """Plain autograd on a fresh copy of the initial model: this rank's gradient of one backward."""
    model = tiny_qwen3().train()
    sft_loss(reference_logprobs(model, ids, mask), mask).backward()
    return [p.grad for p in model.parameters()]


def main() -> None:
    topology = init_distributed(logical_dp=2, timeout_s=60)
    trainer = Trainer(tiny_qwen3().train())
    trainer.add_base_checkpoint()
    ids, mask = batch(seed=topology.rank)
    out = trainer.forward(ids, mask)
    trainer.backward(sft_loss(out.logprobs, mask))
    before = [p.grad.clone() for p in trainer.model.parameters()]
    out = trainer.forward(ids, mask)
    if topology.rank == 1:

        def broken(*args, **kwargs):
            raise RuntimeError("disk full while offloading")

        trainer._differentiate = broken
    try:
        trainer.backward(sft_loss(out.logprobs, mask))
    except GradientTransactionError as error:  # a healthy rank hears which rank failed
        assert topology.rank == 0 and "rank 1: RuntimeError: disk full while offloading" in str(error), error
    except RuntimeError as error:  # the failing rank re-raises its own error
        assert topology.rank == 1 and "disk full" in str(error), error
    else:
        raise AssertionError("backward succeeded although rank 1 failed")
    trainer.__dict__.pop("_differentiate", None)  # rank 1 is healthy again
    unchanged = all(torch.equal(p.grad, b) for p, b in zip(trainer.model.parameters(), before))
    assert unchanged, "an accumulator changed"
    # Every rank retries the very same backward: the healthy rank's graph survived the abort.
    trainer.backward(sft_loss(out.logprobs, mask))
    expected = reference_grads(ids, mask)
    for param, previous, reference in zip(trainer.model.parameters(), before, expected):
        torch.testing.assert_close(param.grad, previous + reference, rtol=1e-5, atol=1e-7)
    # A failure before any graph is touched (here: a loss over a tensor no checkpoint owns, on rank 1 only)
    # goes through the same agreement: every rank raises, none waits for the other.
    out = trainer.forward(ids, mask)
    stray = torch.nn.Parameter(torch.ones(()))
    try:
        trainer.backward(sft_loss(out.logprobs, mask) * (stray if topology.rank == 1 else 1.0))
    except GradientTransactionError as error:
        assert topology.rank == 0 and "rank 1: ValueError" in str(error), error
    except ValueError as error:
        assert topology.rank == 1 and "no checkpoint owns" in str(error), error
    else:
        raise AssertionError("backward succeeded although rank 1's loss was refused")
    report = trainer.step()["base"]
    log(f"OK rank {topology.rank} stepped={report.stepped} revision={report.version.revision}")


if __name__ == "__main__":
    run_rank_process(main)
