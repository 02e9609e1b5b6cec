"""Run under torchrun by test_sharded_trainer: `Trainer(model, parallelism=FullyShard(...))` against unsharded references.

Every check prints one RESULT line per rank (tests/trainer/sharded_ranks.py).
References, built on every rank from the unsharded model fed every rank's
batch in rank order: plain autograd through the trainer's own output function
(`compute_outputs`) on a full copy, each rank's gradient cast to FP32 and
summed in rank order, then `clip_grad_norm_` and `torch.optim.AdamW` on full
FP32 tensors (the masters, for the bf16 recipe).
"""

from __future__ import annotations

import contextlib
import copy
import gc
from unittest import mock

import torch
from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState
from torch.distributed.tensor import DTensor

from tests.trainer.models import tiny_qwen3
from tests.trainer.sharded_ranks import (
    VOCAB,
    all_bitwise,
    bitwise,
    emit,
    full,
    rank_batch,
    start,
    worst,
)
from tests.trainer.sharded_trainer_recipe import (
    CLIPPED,
    OPTIMIZER,
    Recipe,
    backward_on,
    grad_of,
    moments,
    reference_moments,
    sharded_grads,
    sharded_trainer,
    sharded_weights,
    token_loss,
)
from trainer_core.parallel import FullyShard, local_tensor
from trainer_core.parallel.fsdp.shard import ShardSnapshot, shard_model
from trainer_core.run.distributed import run_rank_process
from trainer_core.training import Trainer
from trainer_core.training.outputs import ForwardCall, compute_outputs
from trainer_core.training.staleness import StalenessPolicy


def check_steps(rank, world_size, mesh, dtype, label, optimizer=OPTIMIZER):
    """Two forward/backward/step rounds (two batches accumulated in the second) vs the unsharded recipe."""
    master = tiny_qwen3(vocab=VOCAB)
    trainer = sharded_trainer(master, mesh, dtype=dtype, optimizer=optimizer)
    recipe = Recipe(master, dtype, optimizer)
    checkpoint = trainer.checkpoints["base"]
    no_masters = not checkpoint.master_weights() and all(
        type(p).__name__ == "DTensor" and p.dtype == torch.float32 for p in checkpoint.parameters().values()
    )
    ok_grads, ok_weights, diffs, norms = [], [], [], []
    for rounds in ([1], [2, 3]):
        grads = recipe.grads(rounds[0], world_size)
        for which in rounds[1:]:
            more = recipe.grads(which, world_size)
            grads = {n: grads[n] + more[n] for n in grads}
        for which in rounds:
            backward_on(trainer, which, rank, world_size)
        got = sharded_grads(trainer)
        ok_grads.append(all_bitwise(got, grads))
        diffs.append(worst(got, grads))
        reports = trainer.step()
        norms.append((reports["base"].grad_norm, recipe.step(grads)))
        weights = sharded_weights(trainer)
        ok_weights.append(all_bitwise(weights, recipe.masters) and reports["base"].stepped)
        diffs.append(worst(weights, recipe.masters))
    emit(
        f"steps_{label}",
        rank,
        grads=ok_grads,
        weights=ok_weights,
        moments=all_bitwise(moments(trainer), reference_moments(recipe)),
        no_masters=no_masters,
        max_diff=max(diffs),
        norm_rel_diff=max(abs(a - b) / b for a, b in norms),
    )


def check_fault_after_backward(rank, world_size, mesh):
    """A committed gradient, then a backward that fails after autograd on the last rank: every shard unchanged."""
    master = tiny_qwen3(vocab=VOCAB)
    trainer = sharded_trainer(master, mesh)
    recipe = Recipe(master, torch.float32)
    backward_on(trainer, 1, rank, world_size)
    before = [grad_of(p).clone() for p in trainer.checkpoints["base"].parameters().values()]
    stage = trainer._stage

    def failing_stage(*args):
        stage(*args)
        raise RuntimeError("injected after backward")

    if rank == world_size - 1:
        trainer._stage = failing_stage  # type: ignore[method-assign]
    ids, mask = rank_batch(2, rank)
    # A lone retained graph on one process is freed as autograd runs (as unsharded): replay it there instead.
    out = trainer.forward(ids, mask, mode="retain" if world_size > 1 else "replay")
    loss = token_loss(out.logprobs, mask, 2, world_size)
    try:
        trainer.backward(loss)
        raised = None
    except Exception as error:  # noqa: BLE001 - the check reports what was raised
        raised = type(error).__name__
    after = [grad_of(p) for p in trainer.checkpoints["base"].parameters().values()]
    unchanged = len(before) == len(after) and all(bitwise(a, b) for a, b in zip(before, after))
    trainer._stage = stage  # type: ignore[method-assign]
    trainer.backward(token_loss(out.logprobs, mask, 2, world_size))  # the retry: the forward's graph was kept
    grads = recipe.grads(1, world_size)
    more = recipe.grads(2, world_size)
    expected = {n: grads[n] + more[n] for n in grads}
    got = sharded_grads(trainer)
    emit(
        "fault_after_backward",
        rank,
        raised=raised,
        unchanged=unchanged,
        retry_bitwise=all_bitwise(got, expected),
        max_diff=worst(got, expected),
    )


def check_fault_inside_backward(rank, world_size, mesh):
    """A backward that raises inside autograd (a hook on layer 0's output, every rank), then a new forward and
    backward: FSDP is recovered (units resharded, no partial gradient left), the committed shards unchanged, and
    the sum bitwise the recipe's."""
    master = tiny_qwen3(vocab=VOCAB)
    trainer = sharded_trainer(master, mesh)
    recipe = Recipe(master, torch.float32)
    backward_on(trainer, 1, rank, world_size)
    before = [grad_of(p).clone() for p in trainer.checkpoints["base"].parameters().values()]

    def raise_in_backward(module, inputs, output):
        def fail(grad):
            raise RuntimeError("injected inside backward")

        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.requires_grad:  # replay records without grad, then runs the forward again inside backward
            hidden.register_hook(fail)

    handle = trainer.model.model.layers[0].register_forward_hook(raise_in_backward)
    ids, mask = rank_batch(2, rank)
    out = trainer.forward(ids, mask, mode="replay")
    try:
        trainer.backward(token_loss(out.logprobs, mask, 2, world_size))
        raised = None
    except Exception as error:  # noqa: BLE001 - the check reports what was raised
        raised = str(error)
    finally:
        handle.remove()
    after = [grad_of(p) for p in trainer.checkpoints["base"].parameters().values()]
    unchanged = len(before) == len(after) and all(bitwise(a, b) for a, b in zip(before, after))
    resharded = all(isinstance(p, DTensor) for p in trainer.model.parameters())
    backward_on(trainer, 2, rank, world_size)
    grads, more = recipe.grads(1, world_size), recipe.grads(2, world_size)
    expected = {n: grads[n] + more[n] for n in grads}
    got = sharded_grads(trainer)
    emit(
        "fault_inside_backward",
        rank,
        raised=raised,
        unchanged=unchanged,
        resharded=resharded,
        retry_bitwise=all_bitwise(got, expected),
        max_diff=worst(got, expected),
    )


FORWARD_FAULTS = ("grad", "no_grad", "replay", "replay_in_backward")
"""Where the injected error raises: a forward with grad (retain), one under no_grad, one recorded for replay, and
the replay's re-forward inside backward."""


def forward_fault_run(master, mesh, rank: int, world_size: int, fault: str | None) -> dict:
    """Forward/backward A, then (unless `fault` is None) B raising inside decoder layer 1, every rank; step;
    forward/backward C; step. What C computed and the run's end, and how B left the trainer."""
    trainer = sharded_trainer(master, mesh)
    backward_on(trainer, 1, rank, world_size)
    found: dict = {}
    if fault is not None:
        armed = [fault != "replay_in_backward"]

        def fail(module, inputs, output):
            if armed[0]:
                raise RuntimeError("injected inside decoder layer 1")

        live = [g.graph_id for g in trainer.graphs.live()]
        resident = trainer.resident_bytes()
        handle = trainer.model.model.layers[1].mlp.register_forward_hook(fail)
        ids, mask = rank_batch(2, rank)
        try:
            with torch.no_grad() if fault == "no_grad" else contextlib.nullcontext():
                out = trainer.forward(ids, mask, mode="retain" if fault in ("grad", "no_grad") else "replay")
            armed[0] = True
            trainer.backward(token_loss(out.logprobs, mask, 2, world_size))
            found["raised"] = None
        except RuntimeError as error:
            found["raised"] = str(error)
        finally:
            handle.remove()
        out = None
        gc.collect()  # the failed backward's error, in a cycle with its frames, held B's loss (and so its graph)
        assert isinstance(trainer.parallelism, FullyShard)
        found["resharded"] = all(
            fp.sharded_state is ShardedState.SHARDED for fp in trainer.parallelism.sharded.fsdp_params()
        )
        found["graphs_kept"] = [g.graph_id for g in trainer.graphs.live()] == live
        found["resident_kept"] = trainer.resident_bytes() == resident
    trainer.step()
    ids, mask = rank_batch(3, rank)
    out = trainer.forward(ids, mask, mode="retain")
    loss = token_loss(out.logprobs, mask, 3, world_size)
    trainer.backward(loss)
    grads = sharded_grads(trainer)
    trainer.step()
    return {"found": found, "loss": float(loss).hex(), "grads": grads, "weights": sharded_weights(trainer)}


def check_fault_in_forward(rank, world_size, mesh):
    """A forward that raises inside decoder layer 1 on every rank (with grad, under no_grad, recorded for replay, or
    in a replay's re-forward inside backward) between a step's backward and the step: every FSDP unit is resharded
    at once, the trainer holds the graphs it held, and the next forward/backward and step are bitwise those of the
    run without the failed forward (FSDP left a unit gathered would skip its all-gather: pre-step weights)."""
    master = tiny_qwen3(vocab=VOCAB)
    clean = forward_fault_run(master, mesh, rank, world_size, None)
    cases = {}
    for fault in FORWARD_FAULTS:
        run = forward_fault_run(master, mesh, rank, world_size, fault)
        cases[fault] = {
            **run["found"],
            "loss": run["loss"] == clean["loss"],
            "grads": all_bitwise(run["grads"], clean["grads"]),
            "weights": all_bitwise(run["weights"], clean["weights"]),
            "max_diff": worst(run["weights"], clean["weights"]),
        }
    emit("fault_in_forward", rank, cases=cases)


def check_nonfinite_skip(rank, world_size, mesh):
    """A NaN in one element of the last rank's shard: the step skips on every rank, weights bitwise unchanged."""
    master = tiny_qwen3(vocab=VOCAB)
    trainer = sharded_trainer(master, mesh, nonfinite="skip")
    backward_on(trainer, 1, rank, world_size)
    before = sharded_weights(trainer)
    params = trainer.checkpoints["base"].parameters()
    if rank == world_size - 1:
        grad_of(params["model.embed_tokens.weight"]).view(-1)[-1] = float("nan")
    report = trainer.step()["base"]
    emit(
        "nonfinite_skip",
        rank,
        stepped=report.stepped,
        reason=report.skipped_reason,
        unchanged=all_bitwise(sharded_weights(trainer), before),
        grads_cleared=all(p.grad is None for p in params.values()),
    )


def dropout_grads(master, which: int, world_size: int) -> dict[str, torch.Tensor]:
    """Plain autograd on an unsharded copy in train mode, each rank's dropout seeded as its forward was."""
    model = copy.deepcopy(master)
    total: dict[str, torch.Tensor] = {}
    for r in range(world_size):
        ids, mask = rank_batch(which, r)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1000 + r)
        out = compute_outputs(model, {}, ForwardCall(ids, mask, None, None, ("logprobs",), 0, None))
        token_loss(out["logprobs"], mask, which, world_size).backward()
        for n, p in model.named_parameters():
            total[n] = p.grad.clone() if n not in total else total[n] + p.grad
    return total


def graph_state(trainer, out):
    graph = trainer.graphs.get(out.graph_id)
    assert graph is not None and graph.state is not None
    return graph.state


def check_modes(rank, world_size, mesh):
    """retain / offload / replay with dropout on: the same gradients as each other and as plain autograd; the
    bytes a graph holds (retained) or copies out (offload) are the unsharded trainer's: weights referenced."""
    master = tiny_qwen3(vocab=VOCAB, dropout=0.1).train()
    expected = dropout_grads(master, 1, world_size)
    ids, mask = rank_batch(1, rank)
    grads, held = {}, {}
    for mode in ("retain", "offload", "replay"):
        trainer = sharded_trainer(master, mesh)
        trainer.model.train()
        torch.manual_seed(1000 + rank)
        out = trainer.forward(ids, mask, mode=mode)
        state = graph_state(trainer, out)
        held[mode] = [state.saved_bytes, getattr(getattr(state, "_hooks", None), "offloaded_bytes", None)]
        torch.manual_seed(0)  # the RNG moved on: a replay must restore the forward's
        trainer.backward(token_loss(out.logprobs, mask, 1, world_size))
        grads[mode] = sharded_grads(trainer)
    # The guard: with FSDP's unsharded weights out of the keep set, offload copies them (to disk through numpy,
    # which pins their storage), and FSDP can no longer free them after the forward.
    trainer = sharded_trainer(master, mesh)
    trainer._weight_impls = frozenset()
    try:
        unkept_out = trainer.forward(ids, mask, mode="offload")
        hooks = getattr(graph_state(trainer, unkept_out), "_hooks", None)
        unkept = {"offloaded_bytes": getattr(hooks, "offloaded_bytes", None)}
    except RuntimeError as error:
        unkept = {"error": str(error)}
    unsharded = Trainer(copy.deepcopy(master).train())
    unsharded.add_base_checkpoint()
    reference_held = {}
    for mode in ("retain", "offload"):
        out = unsharded.forward(ids, mask, mode=mode)
        state = graph_state(unsharded, out)
        reference_held[mode] = [state.saved_bytes, getattr(getattr(state, "_hooks", None), "offloaded_bytes", None)]
    emit(
        "modes",
        rank,
        bitwise={mode: all_bitwise(g, expected) for mode, g in grads.items()},
        max_diff={mode: worst(g, expected) for mode, g in grads.items()},
        held=held,
        reference_held=reference_held,
        unkept=unkept,
        weight_bytes=sum(local_tensor(p).numel() * 4 for p in trainer.model.parameters()),
    )


def stale_gradient(master, mesh, rank, world_size, mode, *, swap=True):
    """Forward A, then backward and step on B, then backward A: A's gradient (gathered) and the bytes held."""
    trainer = sharded_trainer(master, mesh)
    ids, mask = rank_batch(1, rank)
    out = trainer.forward(ids, mask, mode=mode)
    backward_on(trainer, 2, rank, world_size)
    with contextlib.ExitStack() as patches:
        if not swap:
            patches.enter_context(mock.patch.object(ShardSnapshot, "swapped_in", lambda self: contextlib.nullcontext()))
        trainer.step()
        held = trainer.graphs.held_weight_bytes(trainer._parameter_storages())
        trainer.backward(token_loss(out.logprobs, mask, 1, world_size))
    assert isinstance(trainer.parallelism, FullyShard)
    shards = sum(fp._sharded_param_data.numel() * 4 for fp in trainer.parallelism.sharded.fsdp_params())
    return sharded_grads(trainer), held, shards


def check_stale(rank, world_size, mesh):
    """A stale graph is differentiated at its forward's weights (plain autograd there), in every mode; without
    the snapshot swapped in, FSDP would gather the stepped weights (guards the test)."""
    master = tiny_qwen3(vocab=VOCAB)
    expected = Recipe(master, torch.float32).grads(1, world_size)
    results = {}
    for mode in ("retain", "offload", "replay"):
        grads, held, shards = stale_gradient(master, mesh, rank, world_size, mode)
        results[mode] = {"bitwise": all_bitwise(grads, expected), "held": held, "shards": shards}
    unswapped, _, _ = stale_gradient(master, mesh, rank, world_size, "retain", swap=False)
    emit("stale", rank, modes=results, unswapped_diff=worst(unswapped, expected))


def check_stale_bf16(rank, world_size, mesh):
    """Under a bf16 MixedPrecisionPolicy the snapshot is kept in bf16 (what the all-gather sends: half the bytes)
    and the stale gradient is bitwise the unsharded bf16 recipe's at the forward-time weights."""
    master = tiny_qwen3(vocab=VOCAB)
    expected = Recipe(master, torch.bfloat16).grads(1, world_size)
    trainer = sharded_trainer(master, mesh, dtype=torch.bfloat16)
    ids, mask = rank_batch(1, rank)
    out = trainer.forward(ids, mask, mode="retain")
    backward_on(trainer, 2, rank, world_size)
    trainer.step()
    held = trainer.graphs.held_weight_bytes(trainer._parameter_storages())
    trainer.backward(token_loss(out.logprobs, mask, 1, world_size))
    assert isinstance(trainer.parallelism, FullyShard)
    shards = sum(fp._sharded_param_data.numel() * 2 for fp in trainer.parallelism.sharded.fsdp_params())
    got = sharded_grads(trainer)
    emit(
        "stale_bf16", rank, bitwise=all_bitwise(got, expected), max_diff=worst(got, expected), held=held, shards=shards
    )


def check_two_snapshots(rank, world_size, mesh):
    """max_gradient_staleness = 2: graphs from two revisions, each with its snapshot (two held at once), each
    differentiated at its own forward's weights, accumulated into one gradient."""
    master = tiny_qwen3(vocab=VOCAB)
    recipe = Recipe(master, torch.float32)
    grads_a = recipe.grads(1, world_size)
    recipe.step(recipe.grads(2, world_size))
    grads_c = recipe.grads(3, world_size)
    expected = {n: grads_a[n] + grads_c[n] for n in grads_a}
    trainer = sharded_trainer(master, mesh)
    ids_a, mask_a = rank_batch(1, rank)
    out_a = trainer.forward(ids_a, mask_a, mode="retain")
    backward_on(trainer, 2, rank, world_size)
    trainer.step()
    ids_c, mask_c = rank_batch(3, rank)
    out_c = trainer.forward(ids_c, mask_c, mode="replay")
    backward_on(trainer, 4, rank, world_size)
    trainer.step()
    held = trainer.graphs.held_weight_bytes(trainer._parameter_storages())
    trainer.backward(token_loss(out_a.logprobs, mask_a, 1, world_size))
    trainer.backward(token_loss(out_c.logprobs, mask_c, 3, world_size))
    assert isinstance(trainer.parallelism, FullyShard)
    shards = sum(fp._sharded_param_data.numel() * 4 for fp in trainer.parallelism.sharded.fsdp_params())
    got = sharded_grads(trainer)
    emit(
        "two_snapshots",
        rank,
        bitwise=all_bitwise(got, expected),
        max_diff=worst(got, expected),
        held=held,
        shards=shards,
        held_after=trainer.graphs.held_weight_bytes(trainer._parameter_storages()),
    )


def check_stale_importance(rank, world_size, mesh):
    """Importance mode: the same forwards, backwards and steps as the unsharded trainer on W processes."""
    master = tiny_qwen3(vocab=VOCAB)
    policy = StalenessPolicy(stale_mode="importance")
    model = copy.deepcopy(master)
    sharded = Trainer(model, parallelism=FullyShard(shard_model(model, mesh)), staleness=policy)
    plain = Trainer(copy.deepcopy(master), staleness=policy)
    for trainer in (sharded, plain):
        trainer.add_base_checkpoint(optimizer=OPTIMIZER)
        ids, mask = rank_batch(1, rank)
        out = trainer.forward(ids, mask, mode="retain")
        backward_on(trainer, 2, rank, world_size)
        trainer.step()
        trainer.backward(token_loss(out.logprobs, mask, 1, world_size))
        trainer.step()
    expected = {n: p.detach() for n, p in plain.checkpoints["base"].parameters().items()}
    got = sharded_weights(sharded)
    emit("stale_importance", rank, bitwise=all_bitwise(got, expected), max_diff=worst(got, expected))


def check_head(rank, world_size, mesh):
    """A value head (unsharded, replicated: all-reduced at the step) over a sharded base, through a stale graph:
    base and head train bitwise as the unsharded trainer with the same head on W processes."""
    master = tiny_qwen3(vocab=VOCAB)
    torch.manual_seed(3)
    head = torch.nn.Linear(master.config.hidden_size, 1)
    model = copy.deepcopy(master)
    sharded = Trainer(model, parallelism=FullyShard(shard_model(model, mesh)))
    plain = Trainer(copy.deepcopy(master))
    for trainer in (sharded, plain):
        trainer.add_base_checkpoint(optimizer=OPTIMIZER)
        trainer.add_module_checkpoint("value", copy.deepcopy(head), optimizer=OPTIMIZER)

        def loss_of(out, which, mask):
            return token_loss(out.logprobs, mask, which, world_size) + out.heads["value"].pow(2).sum() / 100

        outs = {}
        for which in (1, 2):
            ids, mask = rank_batch(which, rank)
            outs[which] = (trainer.forward(ids, mask, outputs=("logprobs", "heads"), mode="retain"), mask)
        trainer.backward(loss_of(outs[2][0], 2, outs[2][1]))
        trainer.step()
        trainer.backward(loss_of(outs[1][0], 1, outs[1][1]))  # stale: the base's snapshot, the head's old revision
        trainer.step()
    expected = {f"{c}.{n}": p.detach() for c in ("base", "value") for n, p in plain.checkpoints[c].parameters().items()}
    got = {
        f"{c}.{n}": full(p.detach()) for c in ("base", "value") for n, p in sharded.checkpoints[c].parameters().items()
    }
    emit("head", rank, bitwise=all_bitwise(got, expected), max_diff=worst(got, expected))


def check_nonfinite_data(rank, world_size, mesh):
    """A NaN in the last rank's loss (its data): accepted under nonfinite='skip', the step skips on every rank."""
    master = tiny_qwen3(vocab=VOCAB)
    trainer = sharded_trainer(master, mesh, nonfinite="skip")
    before = sharded_weights(trainer)
    ids, mask = rank_batch(1, rank)
    out = trainer.forward(ids, mask, mode="retain")
    loss = token_loss(out.logprobs, mask, 1, world_size)
    trainer.backward(loss * float("nan") if rank == world_size - 1 else loss)
    report = trainer.step()["base"]
    emit(
        "nonfinite_data",
        rank,
        stepped=report.stepped,
        reason=report.skipped_reason,
        unchanged=all_bitwise(sharded_weights(trainer), before),
    )


def check_refusals(rank, world_size, mesh):
    master = tiny_qwen3(vocab=VOCAB)
    trainer = sharded_trainer(master, mesh)
    messages = []
    from trainer_core.training.gradient_reduction import RankSum

    for attempt in (
        lambda: setattr(trainer, "gradient_reduction", RankSum()),
        lambda: trainer.add_lora_checkpoint("a", None),
        lambda: trainer.checkpoints["base"].detach_revision(),
    ):
        try:
            attempt()
            messages.append(None)
        except (ValueError, RuntimeError) as error:
            messages.append(str(error))
    emit("refusals", rank, messages=messages)


def main() -> None:
    rank, world_size, mesh = start()
    check_steps(rank, world_size, mesh, torch.float32, "fp32")
    check_steps(rank, world_size, mesh, torch.bfloat16, "bf16")
    check_steps(rank, world_size, mesh, torch.float32, "fp32_clipped", CLIPPED)
    check_steps(rank, world_size, mesh, torch.bfloat16, "bf16_clipped", CLIPPED)
    check_fault_after_backward(rank, world_size, mesh)
    check_fault_inside_backward(rank, world_size, mesh)
    check_fault_in_forward(rank, world_size, mesh)
    check_nonfinite_skip(rank, world_size, mesh)
    check_nonfinite_data(rank, world_size, mesh)
    check_modes(rank, world_size, mesh)
    check_stale(rank, world_size, mesh)
    check_stale_bf16(rank, world_size, mesh)
    check_two_snapshots(rank, world_size, mesh)
    check_stale_importance(rank, world_size, mesh)
    check_head(rank, world_size, mesh)
    check_refusals(rank, world_size, mesh)


if __name__ == "__main__":
    run_rank_process(main)
