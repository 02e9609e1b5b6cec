"""Run under torchrun by test_sharded_state: a sharded checkpoint saved with DCP at one W, restored at another.

`--save DIR` (W = 2): two AdamW steps on a sharded tiny Qwen3, then
`save_sharded_checkpoint`; rank 0 also writes the gathered weights and
moments (`expected.pt`), the reference the loads compare with bit for bit.
`--load DIR` (W = 1, 4): a model built from another seed, sharded, restored;
at W = 1 also restored into an unsharded model. Each rank prints one RESULT
line per check (tests/trainer/sharded_ranks.py).
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

from tests.trainer.models import tiny_qwen3
from tests.trainer.sharded_ranks import all_bitwise, emit, full, loss, start
from trainer_core.parallel.fsdp.checkpoint_io import (
    is_sharded,
    restore_sharded_checkpoint,
    save_sharded_checkpoint,
)
from trainer_core.parallel.fsdp.shard import shard_model
from trainer_core.run.distributed import run_rank_process
from trainer_core.training.checkpoints import Checkpoint, OptimizerConfig

OPTIMIZER = OptimizerConfig(learning_rate=1e-2, weight_decay=0.1)


def checkpoint_of(model) -> Checkpoint:
    return Checkpoint("base", "base", model, list(model.named_parameters()), OPTIMIZER)


def whole_state(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """Every weight and AdamW tensor of the checkpoint, gathered (collective), by name."""
    found = {f"param/{name}": full(p.detach()) for name, p in checkpoint.parameters().items()}
    names = {id(p): name for name, p in checkpoint.parameters().items()}
    for param, state in checkpoint.optimizer.state.items():
        for key, value in sorted(state.items()):
            found[f"{key}/{names[id(param)]}"] = full(value)
    return found


def save(directory: Path, rank: int, world_size: int, mesh) -> None:
    model = tiny_qwen3(seed=0)
    shard_model(model, mesh)
    checkpoint = checkpoint_of(model)
    for which in (1, 2):
        loss(model, which, rank, world_size).backward()
        checkpoint.optimizer.step()
        checkpoint.optimizer.zero_grad(set_to_none=True)
        checkpoint.revision += 1
    save_sharded_checkpoint(checkpoint, directory / "base")
    expected = whole_state(checkpoint)
    if rank == 0:
        torch.save({"state": expected, "identity": checkpoint.identity}, directory / "expected.pt")
    files = sorted(p.name for p in (directory / "base" / "dcp").iterdir())
    emit("saved", rank, sharded=is_sharded(checkpoint), files=files)
    rank_zero_failure(directory / "failing", checkpoint, rank)


def rank_zero_failure(state_dir: Path, checkpoint: Checkpoint, rank: int) -> None:
    """Rank 0 fails putting the state in place (its part alone): every rank must hear it at once, naming it."""
    from unittest import mock

    import trainer_core.run.state as state

    def fail(*_):
        raise OSError("injected: the disk refused meta.json")

    started = time.perf_counter()
    with mock.patch.object(state, "_put_in_place", fail if rank == 0 else state._put_in_place):
        try:
            state.save_sharded_training_state(state_dir, {"base": checkpoint}, {"next_step": 1}, rank)
            raised = None
        except BaseException as error:  # noqa: BLE001 - the test reads what each rank raised
            raised = error
    emit(
        "rank_zero_failure",
        rank,
        raised=type(raised).__name__ if raised is not None else None,
        message=str(raised),
        seconds=time.perf_counter() - started,
        in_place=(state_dir / "meta.json").exists(),
    )


def load(directory: Path, rank: int, world_size: int, mesh) -> None:
    expected = torch.load(directory / "expected.pt")
    model = tiny_qwen3(seed=1)  # other weights: the restore must replace every one
    shard_model(model, mesh)
    checkpoint = checkpoint_of(model)
    before = whole_state(checkpoint)
    restore_sharded_checkpoint(checkpoint, directory / "base")
    got = whole_state(checkpoint)
    emit(
        "restored_sharded",
        rank,
        bitwise=all_bitwise(got, expected["state"]),
        keys=len(got),
        changed=not all_bitwise(before, got),
        revision=checkpoint.revision,
        new_identity=checkpoint.identity != expected["identity"],
        no_gradient=all(p.grad is None for p in model.parameters()),
    )
    if world_size == 1:
        plain = tiny_qwen3(seed=1)
        unsharded = checkpoint_of(plain)
        restore_sharded_checkpoint(unsharded, directory / "base")
        emit("restored_unsharded", rank, bitwise=all_bitwise(whole_state(unsharded), expected["state"]))
        weights_only = checkpoint_of(tiny_qwen3(seed=1))
        restore_sharded_checkpoint(weights_only, directory / "base", with_optimizer=False)
        params = {k: v for k, v in expected["state"].items() if k.startswith("param/")}
        damaged = directory / "damaged"
        shutil.copytree(directory / "base", damaged)
        shard = damaged / "dcp" / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        try:
            restore_sharded_checkpoint(checkpoint_of(tiny_qwen3(seed=1)), damaged)
            emit("damaged", rank, raised=False)
        except ValueError as error:
            emit("damaged", rank, raised=True, message=str(error))
        emit(
            "restored_weights_only",
            rank,
            bitwise=all_bitwise(whole_state(weights_only), params),
            optimizer_empty=not weights_only.optimizer.state,
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--save", type=Path)
    parser.add_argument("--load", type=Path)
    args = parser.parse_args()
    rank, world_size, mesh = start()
    if args.save:
        save(args.save, rank, world_size, mesh)
    else:
        load(args.load, rank, world_size, mesh)


if __name__ == "__main__":
    run_rank_process(main)
