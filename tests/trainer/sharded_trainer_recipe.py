"""The recipe the sharded-trainer checks compare against, and the sharded trainer they drive.

`Recipe`: the unsharded reference on every rank (plain autograd through the
trainer's own `compute_outputs` on a full copy, every rank's batch in rank
order, FP32 gradients summed in rank order, `clip_grad_norm_` and
`torch.optim.AdamW` on full FP32 tensors). `sharded_trainer` and the readers
(`sharded_grads`, `sharded_weights`, `moments`) are what
tests/trainer/sharded_trainer_worker.py and sharded_lora_worker.py compare.
"""

from __future__ import annotations

import copy

import torch

from tests.trainer.sharded_ranks import bf16_reference, full, num_tokens, rank_batch
from trainer_core.parallel import FullyShard, local_tensor
from trainer_core.parallel.fsdp.shard import shard_model
from trainer_core.training import Trainer
from trainer_core.training.checkpoints import OptimizerConfig
from trainer_core.training.outputs import ForwardCall, compute_outputs
from trainer_core.training.transaction import NonFinitePolicy

# Weight decay on. Without clipping every step is bitwise the recipe's at any W. With clipping (always active:
# the norm is far above 0.05) the norm of a sharded gradient is summed from per-shard partial norms, which may
# differ from the unsharded norm in the last bit at W > 1 (plan fact 8), and so may the clipped step.
OPTIMIZER = OptimizerConfig(learning_rate=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=0.0)
CLIPPED = OptimizerConfig(learning_rate=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=0.05)


def grad_of(param: torch.Tensor) -> torch.Tensor:
    """This rank's local gradient shard (the parameter must have one)."""
    assert param.grad is not None
    return local_tensor(param.grad)


def token_loss(logprobs: torch.Tensor | None, mask: torch.Tensor, which: int, world_size: int) -> torch.Tensor:
    """This rank's share of the global mean token loss (a sum over ranks gives the mean)."""
    assert logprobs is not None
    return -(logprobs * mask[:, 1:]).sum() / num_tokens(which, world_size)


class Recipe:
    """The unsharded recipe by hand: plain autograd, FP32 sum in rank order, clip, torch.optim.AdamW on FP32."""

    def __init__(self, master, dtype, optimizer: OptimizerConfig = OPTIMIZER):
        self.config = optimizer
        self.model = bf16_reference(master) if dtype == torch.bfloat16 else copy.deepcopy(master)
        self.masters = {n: p.detach().float().clone().requires_grad_() for n, p in master.named_parameters()}
        c = optimizer
        self.optimizer = torch.optim.AdamW(
            self.masters.values(), lr=c.learning_rate, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay
        )

    def grads(self, which: int, world_size: int) -> dict[str, torch.Tensor]:
        total: dict[str, torch.Tensor] = {}
        for r in range(world_size):
            ids, mask = rank_batch(which, r)
            self.model.zero_grad(set_to_none=True)
            out = compute_outputs(self.model, {}, ForwardCall(ids, mask, None, None, ("logprobs",), 0, None))
            token_loss(out["logprobs"], mask, which, world_size).backward()
            for n, p in self.model.named_parameters():
                total[n] = p.grad.float() if n not in total else total[n] + p.grad.float()
        return total

    def step(self, grads: dict[str, torch.Tensor]) -> float:
        """One step; returns the gradient's norm."""
        for n, m in self.masters.items():
            m.grad = grads[n].clone()
        masters = list(self.masters.values())
        clip = self.config.grad_clip
        norm = (
            torch.nn.utils.clip_grad_norm_(masters, clip) if clip > 0 else torch.nn.utils.get_total_norm(grads.values())
        )
        self.optimizer.step()
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(self.masters[n])
        return float(norm)


def sharded_trainer(master, mesh, *, dtype=torch.float32, nonfinite: NonFinitePolicy = "error", optimizer=OPTIMIZER):
    model = copy.deepcopy(master)
    trainer = Trainer(model, parallelism=FullyShard(shard_model(model, mesh, param_dtype=dtype)), nonfinite=nonfinite)
    trainer.add_base_checkpoint(optimizer=optimizer)
    return trainer


def backward_on(trainer, which: int, rank: int, world_size: int, mode: str = "retain"):
    ids, mask = rank_batch(which, rank)
    out = trainer.forward(ids, mask, mode=mode)
    return trainer.backward(token_loss(out.logprobs, mask, which, world_size))


def sharded_grads(trainer) -> dict[str, torch.Tensor]:
    return {n: full(p.grad) for n, p in trainer.checkpoints["base"].parameters().items()}


def sharded_weights(trainer) -> dict[str, torch.Tensor]:
    return {n: full(p.detach()) for n, p in trainer.checkpoints["base"].parameters().items()}


def moments(trainer) -> dict[str, torch.Tensor]:
    checkpoint = trainer.checkpoints["base"]
    optimized = checkpoint.optimized_parameters()
    return {
        f"{n}.{key}": full(checkpoint.optimizer.state[p][key])
        for n, p in optimized.items()
        for key in ("exp_avg", "exp_avg_sq")
    }


def reference_moments(recipe: Recipe) -> dict[str, torch.Tensor]:
    return {
        f"{n}.{key}": recipe.optimizer.state[m][key]
        for n, m in recipe.masters.items()
        for key in ("exp_avg", "exp_avg_sq")
    }
