"""Run under torchrun by bench.sharding: the benchmark model sharded (FSDP2) vs replicated, the same steps, interleaved.

Every process builds the benchmark model (`bench._models.ModelSpec`, seed 0)
once and gives each side its own copy: `"none"` is the replicated `Trainer`,
`"fsdp"` the `Trainer` over `training.sharding.shard_model` on a 1-D mesh of
all processes. Both train through the logical-DP facade with the
deterministic reduction (`logical_dp` logical ranks, the same seed and
batches), so their losses are bitwise equal at any W: the sharded fold sums
logical ranks in the unsharded fold's order and both steps clip with
`ranks.canonical_norm`.

Per round, each side runs one optimizer step between barriers (device
synchronized on CUDA); rank 0 times it. The bytes are counted from the
tensors each process holds, just before each optimizer step (when
parameters, FP32 masters, AdamW moments and the reduced gradients all
exist): every storage once, a DTensor by its local shard. Rank 0 writes the
figures of every rank to `--out` as JSON.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from bench._models import BETAS, EPS, GRAD_CLIP, LEARNING_RATE, ModelSpec, make_batch, synchronize
from trainer_core.parallel import FullyShard, local_tensor
from trainer_core.parallel.fsdp.shard import shard_model
from trainer_core.ranks import LogicalDataParallel, Topology, pin_threads
from trainer_core.run.distributed import run_rank_process
from trainer_core.training import OptimizerConfig, Trainer

TERMS = ("parameters", "masters", "moments", "gradients")


def held_bytes(trainer: Trainer) -> dict[str, int]:
    """Bytes of the storages this process holds, per term; a storage shared by two terms counts in the first."""
    seen: set[int] = set()

    def count(tensors) -> int:
        total = 0
        for tensor in tensors:
            storage = local_tensor(tensor).untyped_storage()
            if storage._cdata not in seen:
                seen.add(storage._cdata)
                total += storage.nbytes()
        return total

    checkpoints = list(trainer.checkpoints.values())
    optimized = [p for c in checkpoints for p in c.optimized_parameters().values()]
    states = [c.optimizer.state.get(p, {}) for c in checkpoints for p in c.optimized_parameters().values()]
    params = list(trainer.model.parameters())
    return {
        "parameters": count(params),
        "masters": count(m for c in checkpoints for m in c.master_weights().values()),
        "moments": count(s[key] for s in states for key in ("exp_avg", "exp_avg_sq") if key in s),
        # The gradient the optimizer consumes (the master's under bf16), and any left on a parameter.
        "gradients": count(t.grad for t in [*optimized, *params] if t.grad is not None),
    }


def digest(trainer: Trainer) -> str:
    """The bits of the whole FP32 weights AdamW updates (the masters under bf16; a DTensor gathered: collective)."""
    sha = hashlib.sha256()
    for param in (p for c in trainer.checkpoints.values() for p in c.optimized_parameters().values()):
        whole = param.full_tensor() if isinstance(param, DTensor) else param
        sha.update(whole.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


class Side:
    """One trainer over the logical-DP facade; `step` is one optimizer step on one global batch."""

    def __init__(self, name: str, model: torch.nn.Module, mesh, topology: Topology, args: argparse.Namespace):
        self.name, self.device = name, torch.device(args.device)
        bf16 = args.dtype == "bfloat16"
        model = model.to(self.device)
        if name == "fsdp":
            # The FP32 shards are the masters; the all-gather and compute run in bf16 (MixedPrecisionPolicy).
            sharding = shard_model(model, mesh, param_dtype=torch.bfloat16 if bf16 else None)
            self.trainer = Trainer(model, parallelism=FullyShard(sharding))
        else:
            if bf16:  # the unsharded bf16 recipe: bf16 weights from FP32 masters, RoPE's inv_freq kept FP32
                rotary = model.get_submodule("model.rotary_emb")
                inv_freq = rotary.get_buffer("inv_freq").clone()
                model = model.to(torch.bfloat16)
                rotary.inv_freq = inv_freq
            self.trainer = Trainer(model)
        optimizer = OptimizerConfig(
            learning_rate=LEARNING_RATE, betas=BETAS, eps=EPS, weight_decay=0.0, grad_clip=GRAD_CLIP
        )
        checkpoint = self.trainer.add_base_checkpoint(optimizer=optimizer)
        self.ldp = LogicalDataParallel(self.trainer, topology, reduction="deterministic", seed=0)
        self.held: dict[str, int] = {}
        self.losses: list[str] = []
        self.norms: list[str] = []
        self.step_s: list[float] = []
        apply = checkpoint.apply

        def counted_apply(norm, learning_rate):  # the moment every term exists: count, then step
            self.held = held_bytes(self.trainer)
            apply(norm, learning_rate)

        checkpoint.apply = counted_apply

    def step(self, step: int, args: argparse.Namespace) -> None:
        b = make_batch(step, args.batch_size, args.seq_len, args.vocab_size, str(self.device))
        rows = {"input_ids": b.input_ids, "attention_mask": b.attention_mask, "loss_mask": b.loss_mask}
        num_tokens = float(b.loss_mask.sum())
        sums = {}
        for shard in self.ldp.forward_batches(rows, step=step):
            with shard:
                if shard.empty:
                    continue  # a sharded model runs the dummy turn its peers' collectives need
                out = self.trainer.forward(
                    shard.rows["input_ids"], shard.rows["attention_mask"], outputs=("logprobs",), mode="retain"
                )
                assert out.logprobs is not None
                loss_sum = -(out.logprobs * shard.rows["loss_mask"]).sum()
                self.trainer.backward(loss_sum / num_tokens)
                sums[shard.logical_rank] = loss_sum.detach()
        loss = self.ldp.reduce(sums, "sum") / num_tokens
        report = self.ldp.step()["base"]
        if not report.stepped:
            raise RuntimeError(f"{self.name}: step {step} was skipped ({report.skipped_reason})")
        self.losses.append(float(loss).hex())
        self.norms.append(float(report.grad_norm).hex())


def start(device: str, timeout_s: float) -> tuple[int, int, object]:
    """Join torchrun's group (gloo on the CPU, NCCL on CUDA, one GPU per process) and make the 1-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        pin_threads(1)  # one core per process: W processes use W cores, as a run's deterministic processes do
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))
    return rank, world_size, init_device_mesh(device, (world_size,))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--spec", default="{}", help="ModelSpec fields as JSON")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--logical-dp", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    rank, world_size, mesh = start(args.device, timeout_s=600)
    spec = ModelSpec(**json.loads(args.spec))
    args.vocab_size = spec.vocab_size
    model = spec.build(seed=0)
    if args.dtype == "bfloat16":
        # Both sides start from the same masters: a bf16 replica's are its bf16 weights upcast (Checkpoint), so the
        # FP32 shards start from those values too (what a bf16 checkpoint loaded in FP32 holds).
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.to(torch.bfloat16).float())
    topology = Topology(rank, world_size, args.logical_dp)
    sides = [Side(name, copy.deepcopy(model), mesh, topology, args) for name in ("none", "fsdp")]
    del model
    for step in range(args.steps):
        for side in sides:
            dist.barrier()
            synchronize(side.device)
            started = time.perf_counter()
            side.step(step, args)
            synchronize(side.device)
            dist.barrier()
            if step >= args.warmup:
                side.step_s.append(time.perf_counter() - started)
    figures: dict[str, object] = {
        side.name: {
            "held": dist_gather(side.held, world_size),
            "losses": side.losses,
            "norms": side.norms,
            "step_s": side.step_s,
            "weights_digest": digest(side.trainer),
        }
        for side in sides
    }
    if rank == 0:
        figures["world_size"] = world_size
        figures["num_params"] = sum(p.numel() for p in sides[0].trainer.model.parameters())
        args.out.write_text(json.dumps(figures))
    # Every rank leaves together: none tears its process group down while a peer may still be in a collective
    # (a gloo teardown racing a peer's last one aborted a rank once, SIGABRT, with the figures already gathered).
    dist.barrier()


def dist_gather(value: dict, world_size: int) -> list[dict]:
    """Every rank's `value`, in rank order (collective)."""
    gathered: list[dict] = [{} for _ in range(world_size)]
    dist.all_gather_object(gathered, value)
    return gathered


if __name__ == "__main__":
    run_rank_process(main)
