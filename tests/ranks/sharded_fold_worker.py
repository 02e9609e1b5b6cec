"""Run under torchrun by test_sharded_fold: `OrderedFolds` on a `shard_model`ed tiny Qwen3 vs the unsharded fold.

L = 8 logical ranks, run round-robin (ℓ = j·W + p); logical rank 5 has no data
(a dummy forward/backward, sent as +0); the last process fails after its
backward at turn 1 once (the turn is aborted and retried). The reference is
plain autograd on the unsharded model, one gradient per logical rank, folded
by `trainer_core.ranks.reduction.ordered_fold` in logical order with zeros for
the empty rank. `--out DIR` saves rank 0's gathered gradients for the
cross-W comparison in the test. `--replicas R` shards over HSDP's 2-D mesh
(R replicas × W/R shards) instead of a 1-D one.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tests.trainer.models import tiny_qwen3
from tests.trainer.sharded_ranks import (
    all_bitwise,
    bitwise,
    emit,
    gathered_grads,
    loss,
    rank_batch,
    start,
    worst,
)
from trainer_core.parallel.fsdp.fold import OrderedFolds, round_robin_logical_ranks
from trainer_core.parallel.fsdp.shard import shard_model
from trainer_core.ranks.canonical_norm import canonical_norm
from trainer_core.ranks.reduction import ordered_fold
from trainer_core.run.distributed import run_rank_process

LOGICAL = 8
EMPTY = {5}
FAIL_TURN = 1


def reference_fold(reference, loss_of) -> dict[str, torch.Tensor]:
    """Plain autograd per logical rank (zeros for an empty one), folded in logical order."""
    per_rank: list[dict[str, torch.Tensor]] = []
    for logical in range(LOGICAL):
        reference.zero_grad(set_to_none=True)
        if logical in EMPTY:
            per_rank.append({n: torch.zeros_like(p) for n, p in reference.named_parameters()})
            continue
        loss_of(reference, logical).backward()
        per_rank.append({n: p.grad.clone() for n, p in reference.named_parameters()})
    reference.zero_grad(set_to_none=True)
    return {name: ordered_fold(torch.stack([g[name] for g in per_rank])) for name in per_rank[0]}


def reference_turns(reference, losses, logical_dp: int) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Plain autograd for each loss over logical ranks 0 … logical_dp − 1, all folded in that order (zeros where
    a loss's graph does not reach a parameter); and the parameters some loss reached."""
    per_rank: list[dict[str, torch.Tensor]] = []
    reached: set[str] = set()
    for loss_of in losses:
        for logical in range(logical_dp):
            reference.zero_grad(set_to_none=True)
            loss_of(reference, logical).backward()
            grads = {}
            for name, p in reference.named_parameters():
                grads[name] = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                if p.grad is not None:
                    reached.add(name)
            per_rank.append(grads)
    reference.zero_grad(set_to_none=True)
    return {name: ordered_fold(torch.stack([g[name] for g in per_rank])) for name in per_rank[0]}, reached


def full_loss_of(logical_dp: int):
    """The LM loss of a logical rank, normalised over `logical_dp` logical ranks."""
    return lambda model, logical: loss(model, 0, logical, logical_dp)


def hidden_loss(model, logical: int) -> torch.Tensor:
    """A loss on the final norm's output: it reaches the norm but not the lm_head, which share one FSDP unit."""
    ids, mask = rank_batch(2, logical)
    hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    return hidden.float().square().mean() * 1e-2


def _raise_in_backward(module, inputs, output):
    def fail(grad):
        raise RuntimeError("injected inside backward")

    (output[0] if isinstance(output, tuple) else output).register_hook(fail)


def full_loss(model, logical: int) -> torch.Tensor:
    return loss(model, 0, logical, LOGICAL)


def partial_loss(model, logical: int) -> torch.Tensor:
    """A loss whose graph reaches the embedding and the first decoder layer only (the other units get no grad)."""
    ids, mask = rank_batch(1, logical)
    hidden = model(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=True).hidden_states[1]
    return hidden.float().square().mean() * 1e-2


def dummy_loss(model) -> torch.Tensor:
    """An empty logical rank's turn: the same outputs on two tokens, times zero (its fold sends +0 anyway)."""
    ids, mask = rank_batch(0, 0)
    return full_loss_on(model, ids[:1, :2], mask[:1, :2]) * 0


def full_loss_on(model, ids, mask) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    return logits.sum()


def turn(model, folds: OrderedFolds, logical: int, loss_of, *, fail: bool) -> bool:
    """One turn as a transaction: begin, forward + backward, agree over every process, then commit or abort."""
    empty = logical in EMPTY
    folds.begin(empty=empty)
    error = None
    try:
        (dummy_loss(model) if empty else loss_of(model, logical)).backward()
        if fail:
            raise RuntimeError("injected after backward")
    except RuntimeError as exc:
        error = exc
    failed = torch.tensor([1.0 if error else 0.0])
    dist.all_reduce(failed)
    if failed.item():
        folds.abort()
        return False
    folds.commit()
    return True


def hex_of(value: torch.Tensor) -> str:
    """A scalar's exact bits, as float.hex."""
    return float(value.item()).hex()


def check_norm(model, expected: dict[str, torch.Tensor], rank: int) -> None:
    """The canonical norm of the folded shards vs the unsharded gradients' canonical norm and a float64 oracle."""
    shards = [p.grad for p in model.parameters()]
    sharded_norm = canonical_norm(shards)
    plain_norm = canonical_norm([expected[n] for n, _ in model.named_parameters()])
    oracle = torch.cat([g.double().reshape(-1) for g in expected.values()]).norm().item()
    fast_norm = torch.nn.utils.get_total_norm(shards).full_tensor()  # type: ignore[union-attr]  # a DTensor here
    local = shards[-1]._local_tensor  # type: ignore[union-attr]
    kept = local.clone()
    # The last shard's process; under HSDP in every replica (replicas hold the same shards, a NaN too).
    mesh = model.lm_head.weight.device_mesh
    if mesh.get_local_rank(mesh.ndim - 1) == mesh.size(mesh.ndim - 1) - 1 and local.numel():
        local.view(-1)[0] = float("nan")
    nan_norm = canonical_norm(shards)
    local.copy_(kept)
    # Rows of magnitudes 1e-6 … 1e6: any other grouping of the sums moves the float64 result's last bits.
    generator = torch.Generator().manual_seed(7)
    wide = torch.randn(1001, 3, generator=generator, dtype=torch.float64) * torch.logspace(-6, 6, 1001).view(-1, 1)
    placements = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]  # FSDP's, or HSDP's
    wide_sharded = distribute_tensor(wide.float(), mesh, placements)
    narrow = torch.randn(1, 3, generator=generator)  # one row: every process after the first holds none
    narrow_sharded = distribute_tensor(narrow, mesh, placements)
    emit(
        "norm",
        rank,
        wide_hex64=hex_of(canonical_norm([wide_sharded], dtype=torch.float64)),
        wide_unsharded_hex64=hex_of(canonical_norm([wide.float()], dtype=torch.float64)),
        narrow_hex64=hex_of(canonical_norm([narrow_sharded, wide_sharded], dtype=torch.float64)),
        narrow_unsharded_hex64=hex_of(canonical_norm([narrow, wide.float()], dtype=torch.float64)),
        hex=hex_of(sharded_norm),
        hex64=hex_of(canonical_norm(shards, dtype=torch.float64)),
        unsharded_hex64=hex_of(canonical_norm([expected[n] for n, _ in model.named_parameters()], dtype=torch.float64)),
        dtype=str(sharded_norm.dtype),
        equals_unsharded=bitwise(sharded_norm, plain_norm),
        relative_to_oracle=abs(sharded_norm.item() - oracle) / oracle,
        fast_hex=hex_of(fast_norm),
        nan_anywhere_is_nan_everywhere=bool(torch.isnan(nan_norm)),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--replicas", type=int, default=None, help="HSDP: replicas of the 2-D mesh")
    args = parser.parse_args()
    rank, world_size, mesh = start()
    if args.replicas is not None:
        shape = (args.replicas, world_size // args.replicas)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    reference = tiny_qwen3(vocab=97)
    model = copy.deepcopy(reference)
    sharded = shard_model(model, mesh)
    folds = OrderedFolds(sharded)

    unchanged = None
    for j, logical in enumerate(round_robin_logical_ranks(rank, world_size, LOGICAL)):
        before = gathered_grads(model) if j == FAIL_TURN else None
        if not turn(model, folds, logical, full_loss, fail=(j == FAIL_TURN and rank == world_size - 1)):
            unchanged = all_bitwise(gathered_grads(model), before)  # type: ignore[arg-type]  # set at FAIL_TURN
            assert turn(model, folds, logical, full_loss, fail=False)
    grads = gathered_grads(model)
    expected = reference_fold(reference, full_loss)
    # The shard each unit's reduce-scatter hands its owner (padded, FP32): what FSDP's own output buffer holds.
    largest_shard = max(sum(fp.padded_sharded_param_size.numel() * 4 for fp in params) for _, params in folds._units)
    emit(
        "fold",
        rank,
        bitwise=all_bitwise(grads, expected),
        max_diff=worst(grads, expected),
        aborted=unchanged is not None,
        abort_left_gradients_unchanged=unchanged,
        peak_own_bytes=folds.peak_own_bytes,
        largest_shard_bytes=largest_shard,
    )
    if rank == 0:
        torch.save(grads, args.out / f"W{world_size}{'' if args.replicas is None else f'R{args.replicas}'}.pt")
    check_norm(model, expected, rank)

    # After the step's clear: reset, then a turn whose graph reaches two units only.
    folds.reset()
    for logical in round_robin_logical_ranks(rank, world_size, world_size):
        assert turn(model, folds, logical, partial_loss, fail=False)
    expected_partial, reached = reference_turns(reference, [partial_loss], world_size)
    grads = gathered_grads(model)
    unreached = [n for n in grads if n not in reached]
    emit(
        "partial_after_reset",
        rank,
        bitwise=all_bitwise(grads, expected_partial),
        untouched_are_zero=bool(unreached) and all(not grads[n].any() for n in unreached),
        reached=len(reached),
    )

    # A full turn, then one that reaches the final norm but not the lm_head of the same unit.
    folds.reset()
    for loss_of in (full_loss_of(world_size), hidden_loss):
        for logical in round_robin_logical_ranks(rank, world_size, world_size):
            assert turn(model, folds, logical, loss_of, fail=False)
    expected_mixed, _ = reference_turns(reference, [full_loss_of(world_size), hidden_loss], world_size)
    mixed = gathered_grads(model)
    emit("part_of_a_unit", rank, bitwise=all_bitwise(mixed, expected_mixed), max_diff=worst(mixed, expected_mixed))

    # An exception inside the backward (a hook on layer 0's output raises on every rank), an abort, a retry.
    folds.reset()
    first = round_robin_logical_ranks(rank, world_size, world_size)[0]
    folds.begin()
    raised = False
    handle = model.model.layers[0].register_forward_hook(_raise_in_backward)
    try:
        full_loss_of(world_size)(model, first).backward()
    except RuntimeError as exc:
        raised = "injected inside backward" in str(exc)
    finally:
        handle.remove()
    folds.abort()
    resharded = all(isinstance(p, DTensor) for p in model.parameters())
    assert turn(model, folds, first, full_loss_of(world_size), fail=False)
    expected_retry, _ = reference_turns(reference, [full_loss_of(world_size)], world_size)
    retried = gathered_grads(model)
    emit(
        "exception_inside_backward",
        rank,
        raised=raised,
        resharded_after_abort=resharded,
        bitwise=all_bitwise(retried, expected_retry),
        max_diff=worst(retried, expected_retry),
    )

    # A backward outside a turn is refused at W > 1 (its fold would have no turn to belong to). At W = 1 FSDP
    # calls no comm, so nothing can see it: the test expects no refusal there.
    refused = False
    try:
        full_loss(model, rank).backward()
    except RuntimeError as exc:
        refused = "outside OrderedFolds.begin()" in str(exc)
    emit("outside_a_turn", rank, refused=refused)


if __name__ == "__main__":
    run_rank_process(main)
