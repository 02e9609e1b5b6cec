"""Run under torchrun by test_sharding_basics: `shard_model` and `ShardSnapshot` against unsharded references.

Each check prints one RESULT line per rank (tests/trainer/sharded_ranks.py).
`--dcp-save DIR` (W = 2) also saves the stepped model and AdamW state with
torch.distributed.checkpoint; `--dcp-load DIR --saved-world-size 2` (W = 1)
loads it into a sharded and into a plain model and compares both with an
unsharded AdamW step recomputed here.
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tests.trainer.models import tiny_qwen3
from tests.trainer.sharded_ranks import (
    all_bitwise,
    bf16_reference,
    bitwise,
    emit,
    full,
    gathered,
    gathered_grads,
    loss,
    max_diff,
    rank_batch,
    start,
    summed_grads,
    worst,
)
from trainer_core.parallel.fsdp.shard import ShardSnapshot, shard_model
from trainer_core.run.distributed import run_rank_process

ADAMW = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.95)}


def sharded_copy(master, mesh, **kwargs):
    model = copy.deepcopy(master)
    return model, shard_model(model, mesh, **kwargs)


def check_logits(rank, world_size, mesh):
    reference = tiny_qwen3(vocab=97)
    model, _ = sharded_copy(reference, mesh)
    ids, mask = rank_batch(0, rank)
    with torch.no_grad():
        sharded = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        plain = reference(input_ids=ids, attention_mask=mask, use_cache=False).logits
    emit("logits", rank, bitwise=bitwise(sharded, plain), max_diff=max_diff(sharded, plain))


def reference_adamw_step(reference, grads):
    """torch.optim.AdamW on the full FP32 copy, fed the summed gradient; returns its moments by name."""
    for name, p in reference.named_parameters():
        p.grad = grads[name].clone()
    optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
    optimizer.step()
    names = {p: n for n, p in reference.named_parameters()}
    return {names[p]: s for p, s in optimizer.state.items()}


def check_sum_and_adamw(rank, world_size, mesh, dcp_dir):
    reference = tiny_qwen3(vocab=97)
    model, _ = sharded_copy(reference, mesh)
    loss(model, 1, rank, world_size).backward()
    grads = summed_grads(reference, 1, world_size)
    sharded_grads = gathered_grads(model)
    emit("sum_reduction", rank, bitwise=all_bitwise(sharded_grads, grads), max_diff=worst(sharded_grads, grads))

    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    optimizer.step()
    reference_state = reference_adamw_step(reference, grads)
    names: dict[torch.Tensor, str] = {p: n for n, p in model.named_parameters()}
    moments_equal = all(
        bitwise(state[key].full_tensor(), reference_state[names[p]][key])
        for p, state in optimizer.state.items()
        for key in ("exp_avg", "exp_avg_sq")
    )
    stepped, expected = gathered(model), dict(reference.named_parameters())
    emit(
        "adamw_step",
        rank,
        params_bitwise=all_bitwise(stepped, {n: p.detach() for n, p in expected.items()}),
        moments_bitwise=moments_equal,
        num_states=len(optimizer.state),
        max_diff=worst(stepped, {n: p.detach() for n, p in expected.items()}),
    )
    if dcp_dir:
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp_save({"model": model_state, "optim": optim_state}, checkpoint_id=dcp_dir)
        emit("dcp_saved", rank, ok=True)


def check_bf16(rank, world_size, mesh):
    master = tiny_qwen3(vocab=97)  # FP32: the sharded parameters are the masters
    model, sharded = sharded_copy(master, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    reference = bf16_reference(master)
    ids, mask = rank_batch(0, rank)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        expected = reference(input_ids=ids, attention_mask=mask, use_cache=False).logits
    loss(model, 1, rank, world_size).backward()
    grads, expected_grads = gathered_grads(model), summed_grads(reference, 1, world_size)
    emit(
        "bf16",
        rank,
        logits_bitwise=bitwise(logits, expected),
        logits_dtype=str(logits.dtype),
        masters_dtype=str({p.dtype for p in model.parameters()}),
        grads_bitwise=all_bitwise(grads, expected_grads),
        grads_max_diff=worst(grads, expected_grads),
    )
    # A stale graph under bf16: its snapshot is kept in bf16 (what the all-gather sends), half the bytes.
    model.zero_grad(set_to_none=True)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    stale = loss(model, 2, rank, world_size)
    snapshot = ShardSnapshot.capture(sharded.fsdp_params())
    fp32_bytes = sum(fp._sharded_param_data.numel() * 4 for fp in sharded.fsdp_params())
    loss(model, 3, rank, world_size).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with snapshot.swapped_in():
        stale.backward()
    stale_grads, expected_stale = gathered_grads(model), summed_grads(reference, 2, world_size)
    emit(
        "bf16_stale",
        rank,
        bitwise=all_bitwise(stale_grads, expected_stale),
        max_diff=worst(stale_grads, expected_stale),
        snapshot_bytes=snapshot.nbytes,
        fp32_shard_bytes=fp32_bytes,
        live_fp32=all(fp._sharded_param_data.dtype == torch.float32 for fp in sharded.fsdp_params()),
    )


def stale_graph(rank, world_size, mesh, *, with_snapshot: bool) -> dict:
    """Forward A at revision 0, step on batch B, backward A: the gradient vs plain autograd at both revisions."""
    reference = tiny_qwen3(vocab=97)
    model, sharded = sharded_copy(reference, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    stale = loss(model, 2, rank, world_size)  # graph A, at revision 0
    snapshot = ShardSnapshot.capture(sharded.fsdp_params()) if with_snapshot else None
    loss(model, 3, rank, world_size).backward()
    optimizer.step()  # revision 1
    optimizer.zero_grad(set_to_none=True)
    current = gathered(model)
    if snapshot is not None:
        with snapshot.swapped_in():
            stale.backward()
    else:
        stale.backward()
    grads = gathered_grads(model)
    at_forward = summed_grads(reference, 2, world_size)
    now = copy.deepcopy(reference)
    with torch.no_grad():
        for name, p in now.named_parameters():
            p.copy_(current[name])
    at_current = summed_grads(now, 2, world_size)
    ids, mask = rank_batch(4, rank)
    with torch.no_grad():
        next_logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        expected_next = now(input_ids=ids, attention_mask=mask, use_cache=False).logits
    return {
        "bitwise_at_forward_weights": all_bitwise(grads, at_forward),
        "max_diff_at_forward_weights": worst(grads, at_forward),
        "max_diff_at_current_weights": worst(grads, at_current),
        "weights_unchanged": all_bitwise(gathered(model), current),
        "next_forward_at_current_weights": bitwise(next_logits, expected_next),
    }


def check_stale(rank, world_size, mesh):
    emit("stale_without_snapshot", rank, **stale_graph(rank, world_size, mesh, with_snapshot=False))
    emit("stale_with_snapshot", rank, **stale_graph(rank, world_size, mesh, with_snapshot=True))


def check_tied(rank, world_size, mesh):
    reference = tiny_qwen3(vocab=97)
    reference.config.tie_word_embeddings = True
    reference.lm_head.weight = reference.model.embed_tokens.weight
    model, sharded = sharded_copy(reference, mesh)
    loss(model, 1, rank, world_size).backward()
    grads, expected = gathered_grads(model), summed_grads(reference, 1, world_size)
    emit(
        "tied",
        rank,
        bitwise=all_bitwise(grads, expected),
        num_units=len(sharded.units),
        num_params=len(grads),
    )


def check_unsharded_storages(rank, world_size, mesh):
    model, sharded = sharded_copy(tiny_qwen3(vocab=97), mesh)
    before = sharded.unsharded_storages()
    loss(model, 1, rank, world_size).backward()
    emit(
        "unsharded_storages",
        rank,
        count=len(before),
        num_fsdp_params=len(sharded.fsdp_params()),
        num_units=len(sharded.units),
        stable=before == sharded.unsharded_storages(),
        # A checkpoint's subset: found by its sharded parameters' identity.
        subset=[fp.sharded_param is model.lm_head.weight for fp in sharded.fsdp_params([model.lm_head.weight])],
    )


def check_dcp_load(rank, mesh, dcp_dir, saved_world_size):
    """Load the W = saved_world_size state at this W, into a sharded and a plain model, vs a recomputed reference."""
    reference = tiny_qwen3(vocab=97)
    reference_state = reference_adamw_step(reference, summed_grads(reference, 1, saved_world_size))
    expected = {n: p.detach() for n, p in reference.named_parameters()}
    for kind in ("sharded", "plain"):
        model = tiny_qwen3(seed=7, vocab=97)  # other weights: the load must replace them
        if kind == "sharded":
            shard_model(model, mesh)
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp_load(state, checkpoint_id=dcp_dir)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        names: dict[torch.Tensor, str] = {p: n for n, p in model.named_parameters()}
        moments = all(
            bitwise(full(s[key]), reference_state[names[p]][key])
            for p, s in optimizer.state.items()
            for key in ("exp_avg", "exp_avg_sq", "step")
        )
        emit(
            f"dcp_load_{kind}",
            rank,
            params_bitwise=all_bitwise(gathered(model), expected),
            moments_bitwise=moments,
            num_states=len(optimizer.state),
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dcp-save")
    parser.add_argument("--dcp-load")
    parser.add_argument("--saved-world-size", type=int, default=2)
    args = parser.parse_args()
    rank, world_size, mesh = start()
    check_logits(rank, world_size, mesh)
    check_sum_and_adamw(rank, world_size, mesh, args.dcp_save)
    check_bf16(rank, world_size, mesh)
    check_stale(rank, world_size, mesh)
    check_tied(rank, world_size, mesh)
    check_unsharded_storages(rank, world_size, mesh)
    if args.dcp_load:
        check_dcp_load(rank, mesh, args.dcp_load, args.saved_world_size)


if __name__ == "__main__":
    run_rank_process(main)
