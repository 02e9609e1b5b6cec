"""The deterministic fold's send buffer is written element by element (`flat_partials.pack_partials`, used by the
fold at the step and by the buckets of the overlapped one), never zero-filled first: a logical rank without a
gradient must still count as zeros.

The buffer is allocated here full of NaN (what reused memory may hold), and the step's gradient is compared with
the plain sum of each logical rank's gradient, folded in logical order."""

from __future__ import annotations

import torch

import trainer_core.ranks.flat_partials as flat_partials_module
from trainer_core.ranks import LogicalGradients, Topology
from trainer_core.training import Trainer


class _NaNMemory:
    """`torch` as the fold sees it, with `empty` handing out NaN-filled tensors."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*shape, **kwargs):
        return torch.full(shape, float("nan"), **kwargs)


def test_a_missing_gradient_and_the_padding_count_as_zeros_whatever_the_buffer_held(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    trainer = Trainer(model)
    trainer.add_base_checkpoint()
    topology = Topology(0, 1, 3)
    gradients = LogicalGradients(trainer, topology, "deterministic")
    trainer.gradient_reduction = gradients
    inputs = torch.randn(3, 2, 3, generator=torch.Generator().manual_seed(1))
    expected = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for logical_rank in range(3):
        with gradients.scope(logical_rank):
            if logical_rank == 1:
                continue  # no gradient at all on logical rank 1
            partial = torch.autograd.grad(model(inputs[logical_rank]).sum(), list(model.parameters()))
            trainer.backward(model(inputs[logical_rank]).sum())
            for (name, _), grad in zip(model.named_parameters(), partial, strict=True):
                expected[name] = expected[name] + grad
    (checkpoint,) = trainer.checkpoints.values()
    monkeypatch.setattr(flat_partials_module, "torch", _NaNMemory())
    gradients.reduce([checkpoint], [[True] * len(checkpoint.parameters())])
    monkeypatch.undo()
    for name, summed in expected.items():
        assert torch.equal(checkpoint.optimized_parameters()[name].grad, summed), name
