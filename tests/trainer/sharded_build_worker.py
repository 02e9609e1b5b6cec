"""Run under torchrun by test_sharded_build: `build_trainer` for a `model.path` run under fsdp vs from_pretrained.

Every check prints one RESULT line per rank (tests/trainer/sharded_ranks.py).
Rank 0 saves the tiny example model into `--out/model`; every rank builds the
trainer of a `model.path` config twice: with `build_trainer` (the meta-device
load, `fsdp.load`: each rank reads its own rows, the LoRA adapter injected
on meta) and with the from_pretrained path it replaces (the whole model
loaded on every rank, the adapter injected at the seed, then `shard_model`).
It compares every FSDP shard (padding included) bitwise, then runs one
training step on each (forward with dropout, backward, AdamW) and compares
the losses, the gradients and the stepped shards bitwise.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from tests.conftest import tiny_tree
from tests.trainer.sharded_ranks import bitwise, emit, start
from trainer_core.config import config_from_dict
from trainer_core.model import LORA_CHECKPOINT, _compute_dtype, build_model, build_trainer
from trainer_core.parallel import FullyShard
from trainer_core.parallel.fsdp.shard import shard_model
from trainer_core.run.distributed import run_rank_process
from trainer_core.training.lora_injection import inject_lora

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.1, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def from_pretrained_then_shard(config, mesh, lora):
    """The reference: what build_trainer did for model.path under fsdp before the meta-device load."""
    model, true_vocab = build_model(config)
    if lora is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.run.seed)
            inject_lora(model, LORA_CHECKPOINT, lora, round_to=_compute_dtype(config))
    return shard_model(model, mesh, param_dtype=_compute_dtype(config)), true_vocab


def shards(trainer) -> dict[str, torch.Tensor]:
    assert isinstance(trainer.parallelism, FullyShard)
    return {fp._param_fqn: fp._sharded_param_data.clone() for fp in trainer.parallelism.sharded.fsdp_params()}


def first_step(trainer, rank: int):
    """One step on this rank's rows of the run's first batch; returns (loss, this rank's gradient shards)."""
    (checkpoint,) = trainer.checkpoints.values()
    generator = torch.Generator().manual_seed(rank)
    ids = torch.randint(3, 200, (2, 16), generator=generator)
    mask = torch.ones_like(ids)
    trainer.model.train()
    torch.manual_seed(11 + rank)  # dropout: the same draws on both sides
    out = trainer.forward(ids, mask, mode="retain")
    loss = -(out.logprobs * mask[:, 1:]).sum() / (2 * 15 * dist.get_world_size())
    trainer.backward(loss)
    grads = {n: p.grad._local_tensor.clone() for n, p in checkpoint.parameters().items()}
    trainer.step()
    return loss.detach(), grads


def check(rank, mesh, out: Path, label: str, **sections):
    model_dir = out / "model"
    tree = tiny_tree(out / label, **sections)
    tree["model"] = {"path": str(model_dir), **{k: v for k, v in tree["model"].items() if k != "config"}}
    config = config_from_dict(tree, config_dir=out)
    loaded = build_trainer(config, mesh=mesh)
    with mock.patch("trainer_core.model._load_sharded", from_pretrained_then_shard):
        reference = build_trainer(config, mesh=mesh)
    before = shards(loaded), shards(reference)
    same_shards = before[0].keys() == before[1].keys() and all(bitwise(before[0][k], before[1][k]) for k in before[0])
    (loss, grads), (reference_loss, reference_grads) = first_step(loaded, rank), first_step(reference, rank)
    after = shards(loaded), shards(reference)
    emit(
        label,
        rank,
        same_shards=same_shards,
        num_shards=len(before[0]),
        adapter_shards=sum("lora_" in k for k in before[0]),
        vocab=[loaded.vocab_size, reference.vocab_size],
        loss_bitwise=bitwise(loss, reference_loss),
        loss=float(loss),
        grads_bitwise=grads.keys() == reference_grads.keys()
        and all(bitwise(grads[k], reference_grads[k]) for k in grads),
        stepped_bitwise=all(bitwise(after[0][k], after[1][k]) for k in after[0]),
        moved=any(not bitwise(after[0][k], before[0][k]) for k in after[0]),
    )


def check_masters(rank, out: Path, label: str, mesh, *, from_path: bool, **sections):
    """A sharded bf16 run's FP32 shards vs the unsharded bf16 run's masters, and their first forward's loss.

    The unsharded run builds (or loads) the model in bf16 and steps FP32 masters upcast from those weights; the
    sharded run's shards are its masters. Both must start bitwise equal, from an FP32 checkpoint too (both round
    its values through bf16).
    """
    tree = tiny_tree(out / label, **sections)
    if from_path:
        tree["model"] = {"path": str(out / "model"), **{k: v for k, v in tree["model"].items() if k != "config"}}
    sharded = build_trainer(config_from_dict(tree, config_dir=out), mesh=mesh)
    tree["train"] = {**tree["train"], "sharding": "none"}
    replica = build_trainer(config_from_dict(tree, config_dir=out))
    (ours,), (theirs,) = sharded.checkpoints.values(), replica.checkpoints.values()
    masters = {n: p.full_tensor() for n, p in ours.optimized_parameters().items()}
    expected = theirs.optimized_parameters()
    ids = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(rank))
    mask = torch.ones_like(ids)
    losses = []
    for trainer in (sharded, replica):
        trainer.model.eval()
        with torch.no_grad():
            out_ = trainer.forward(ids, mask, mode="retain")
            losses.append(-(out_.logprobs * mask[:, 1:]).sum())
    emit(
        label,
        rank,
        masters_bitwise=masters.keys() == expected.keys() and all(bitwise(masters[k], expected[k]) for k in masters),
        masters_fp32=all(m.dtype == torch.float32 for m in masters.values()),
        num_masters=len(masters),
        replica_bf16=all(p.dtype == torch.bfloat16 for p in theirs.parameters().values()),
        loss_bitwise=bitwise(losses[0], losses[1]),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    rank, _, mesh = start()
    if rank == 0:
        base = config_from_dict(tiny_tree(out / "base"), config_dir=out)
        build_model(base)[0].save_pretrained(str(out / "model"))
    dist.barrier()
    fsdp = {"sharding": "fsdp", "reduction": "fast"}
    check(rank, mesh, out, "full_fp32", train=fsdp)
    check(rank, mesh, out, "lora_fp32", train=fsdp, model={"lora": LORA})
    check(
        rank,
        mesh,
        out,
        "lora_bf16_blocks_padded",
        train={**fsdp, "dtype": "bfloat16", "activation_checkpointing": "blocks"},
        model={"lora": LORA, "pad_vocab_to_multiple_of": 64},
    )
    bf16 = {**fsdp, "dtype": "bfloat16"}
    check_masters(rank, out, "bf16_masters_from_fp32_checkpoint", mesh, from_path=True, train=bf16)
    check_masters(rank, out, "bf16_masters_from_config", mesh, from_path=False, train=bf16)


if __name__ == "__main__":
    run_rank_process(main)
