"""Run under torchrun by test_distributed_transaction: rank 1 fails mid-backward."""

from __future__ import annotations

import torch

from tests.trainer.models import batch, tiny_qwen3
from tests.trainer.test_backward_state import sft_loss
from trainer_core.distributed import init_distributed, log, run_rank_main
from trainer_core.trainer import Trainer
from trainer_core.transaction import GradientTransactionError


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
    # The ranks still work together afterwards: a clean backward and step succeed.
    trainer.backward(sft_loss(trainer.forward(ids, mask).logprobs, mask))
    report = trainer.step()["base"]
    log(f"OK rank {topology.rank} stepped={report.stepped} revision={report.version.revision}")


if __name__ == "__main__":
    run_rank_main(main)
