"""Run under torchrun by test_sharded_lora: LoRA adapters and a head over a sharded frozen base vs unsharded peft.

Every check prints one RESULT line per rank (tests/trainer/sharded_ranks.py).
The sharded side: `inject_lora` before `shard_model`, `Trainer(parallelism=FullyShard(...))`,
`add_lora_checkpoint` adopting the injected adapter. The reference, built on
every rank: the unsharded model with the same adapters injected by peft at
the same seeds (bf16: the model cast to bf16 first, as the unsharded bf16 run
builds it), plain autograd through the trainer's own output function with
peft's `set_adapter` switch, every rank's gradient cast to FP32 and summed in
rank order, and `torch.optim.AdamW` on FP32 copies of the adapter weights.
"""

from __future__ import annotations

import argparse
import copy
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, inject_adapter_in_model
from peft.tuners.tuners_utils import set_adapter

from tests.trainer.models import tiny_qwen3
from tests.trainer.sharded_ranks import (
    VOCAB,
    all_bitwise,
    bf16_reference,
    bitwise,
    emit,
    full,
    max_diff,
    rank_batch,
    start,
    worst,
)
from tests.trainer.sharded_trainer_recipe import OPTIMIZER, token_loss
from trainer_core.parallel import FullyShard, local_tensor
from trainer_core.parallel.fsdp.adapter_export import export_sharded_adapter
from trainer_core.parallel.fsdp.shard import shard_model
from trainer_core.run.distributed import run_rank_process
from trainer_core.training import Trainer
from trainer_core.training.lora_injection import adapter_parameters, inject_lora
from trainer_core.training.outputs import HEAD_PREFIX, ForwardCall, compute_outputs

LORA = {
    "a": (LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False), 1),
    "b": (LoraConfig(r=2, lora_alpha=4, target_modules=["k_proj", "v_proj", "down_proj"], init_lora_weights=False), 2),
}


def is_adapter(name: str) -> bool:
    return "lora_" in name


class Reference:
    """Unsharded peft: the adapters injected at their seeds, plain autograd summed over ranks, AdamW on FP32."""

    def __init__(self, master, adapters, dtype, head=None):
        self.model = bf16_reference(master) if dtype == torch.bfloat16 else copy.deepcopy(master)
        for name in adapters:
            config, seed = LORA[name]
            torch.manual_seed(seed)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")  # several, on purpose
                inject_adapter_in_model(config, self.model, adapter_name=name)
        self.head = None if head is None else copy.deepcopy(head)
        self.masters: dict[str, dict[str, torch.Tensor]] = {
            name: {n: p.detach().float().clone().requires_grad_() for n, p in adapter_parameters(self.model, name)}
            for name in adapters
        }
        if self.head is not None:
            self.masters["value"] = {n: p.detach().clone().requires_grad_() for n, p in self.head.named_parameters()}
        c = OPTIMIZER
        self.optimizers = {
            name: torch.optim.AdamW(
                m.values(), lr=c.learning_rate, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay
            )
            for name, m in self.masters.items()
        }

    def grads(self, adapter: str, which: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
        set_adapter(self.model, adapter)  # the others stop running (and stop requiring grad)
        params = dict(adapter_parameters(self.model, adapter))
        heads = {} if self.head is None else {"value": self.head}
        owned = {adapter: params, **({} if self.head is None else {"value": dict(self.head.named_parameters())})}
        total: dict[str, dict[str, torch.Tensor]] = {c: {} for c in owned}
        for r in range(world_size):
            ids, mask = rank_batch(which, r)
            fields = ("logprobs", "heads") if heads else ("logprobs",)
            out = compute_outputs(self.model, heads, ForwardCall(ids, mask, None, None, fields, 0, adapter))
            loss = token_loss(out["logprobs"], mask, which, world_size)
            if heads:
                loss = loss + out[HEAD_PREFIX + "value"].pow(2).sum() / 100
            tensors = [p for c in owned.values() for p in c.values()]
            grads = torch.autograd.grad(loss, tensors)
            flat = iter(grads)
            for c, ps in owned.items():
                for n in ps:
                    g = next(flat).float()
                    total[c][n] = g if n not in total[c] else total[c][n] + g
        return total

    def step(self, grads: dict[str, dict[str, torch.Tensor]]) -> None:
        for c, named in grads.items():
            for n, g in named.items():
                self.masters[c][n].grad = g.clone()
            self.optimizers[c].step()
            self.optimizers[c].zero_grad(set_to_none=True)
        live = {
            **dict(self.model.named_parameters()),
            **({} if self.head is None else dict(self.head.named_parameters())),
        }
        with torch.no_grad():
            for named in self.masters.values():
                for n, m in named.items():
                    live[n].copy_(m)

    def moments(self, checkpoint: str) -> dict[str, torch.Tensor]:
        state = self.optimizers[checkpoint].state
        return {f"{n}.{k}": state[m][k] for n, m in self.masters[checkpoint].items() for k in ("exp_avg", "exp_avg_sq")}


def sharded_lora_trainer(master, mesh, adapters, dtype=torch.float32, head=None):
    model = copy.deepcopy(master)
    for name in adapters:
        config, seed = LORA[name]
        torch.manual_seed(seed)
        inject_lora(model, name, config, round_to=None if dtype == torch.float32 else dtype)
    trainer = Trainer(
        model, parallelism=FullyShard(shard_model(model, mesh, param_dtype=None if dtype == torch.float32 else dtype))
    )
    for name in adapters:
        trainer.add_lora_checkpoint(name, LORA[name][0], optimizer=OPTIMIZER)
    if head is not None:
        trainer.add_module_checkpoint("value", copy.deepcopy(head), optimizer=OPTIMIZER)
    return trainer


def weights(trainer, checkpoint: str) -> dict[str, torch.Tensor]:
    return {n: full(p.detach()) for n, p in trainer.checkpoints[checkpoint].parameters().items()}


def grads(trainer, checkpoint: str) -> dict[str, torch.Tensor]:
    return {n: full(p.grad) for n, p in trainer.checkpoints[checkpoint].parameters().items() if p.grad is not None}


def moments(trainer, checkpoint: str) -> dict[str, torch.Tensor]:
    c = trainer.checkpoints[checkpoint]
    return {
        f"{n}.{k}": full(c.optimizer.state[p][k])
        for n, p in c.optimized_parameters().items()
        for k in ("exp_avg", "exp_avg_sq")
    }


def base_weights(model) -> dict[str, torch.Tensor]:
    return {n: full(p.detach()) for n, p in model.named_parameters() if not is_adapter(n)}


def backward_on(trainer, which, rank, world_size, adapter="a", mode="retain"):
    ids, mask = rank_batch(which, rank)
    out = trainer.forward(ids, mask, mode=mode, checkpoint=adapter)
    trainer.backward(token_loss(out.logprobs, mask, which, world_size))


def check_steps(rank, world_size, mesh, dtype, label, out_dir: Path | None):
    """Two steps of adapter 'a' (two batches accumulated in the second) vs unsharded peft + AdamW; the frozen base
    gets no gradient, no optimizer state and stays bitwise; then (FP32) the exported adapter under peft."""
    master = tiny_qwen3(vocab=VOCAB)
    reference = Reference(master, ["a"], dtype)
    trainer = sharded_lora_trainer(master, mesh, ["a"], dtype)
    model = trainer.model
    ref_base = {n: p.detach().float() for n, p in master.named_parameters()}
    init = all_bitwise(weights(trainer, "a"), reference.masters["a"])
    grad_ok, weight_ok = [], []
    for rounds in ([1], [2, 3]):
        expected = {"a": {}}
        for which in rounds:
            got = reference.grads("a", which, world_size)["a"]
            expected["a"] = {n: g if n not in expected["a"] else expected["a"][n] + g for n, g in got.items()}
            backward_on(trainer, which, rank, world_size)
        found = grads(trainer, "a")
        grad_ok.append(all_bitwise(found, expected["a"]))
        base_grads = [n for n, p in model.named_parameters() if not is_adapter(n) and p.grad is not None]
        trainer.step()
        reference.step(expected)
        weight_ok.append(all_bitwise(weights(trainer, "a"), reference.masters["a"]))
    checkpoint = trainer.checkpoints["a"]
    optimized = {id(p) for p in checkpoint.optimized_parameters().values()}
    state_keys = {id(p) for p in checkpoint.optimizer.state}
    adapter_ids = {id(p) for _, p in adapter_parameters(model, "a")}
    result = dict(
        init=init,
        grads=grad_ok,
        weights=weight_ok,
        moments=all_bitwise(moments(trainer, "a"), reference.moments("a")),
        max_diff=worst(weights(trainer, "a"), reference.masters["a"]),
        base_grads=base_grads,
        base_frozen=all(not p.requires_grad for n, p in model.named_parameters() if not is_adapter(n)),
        base_unchanged=all_bitwise(
            base_weights(model), {n: ref_base[n.replace(".base_layer", "")] for n in base_weights(model)}
        ),
        optimizer_holds_adapter_only=state_keys == optimized == adapter_ids,
        adapter_elements=sum(local_tensor(p).numel() for _, p in adapter_parameters(model, "a")),
    )
    if out_dir is not None:
        result.update(exported_adapter(trainer, master, rank, out_dir))
    emit(f"steps_{label}", rank, **result)


def exported_adapter(trainer, master, rank, out_dir: Path) -> dict:
    """Export adapter 'a' from the shards; rank 0 loads it with peft over the base and compares the trainer's logits."""
    target = out_dir / "adapter"
    if rank == 0:
        target.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    assert isinstance(trainer.parallelism, FullyShard)
    export_sharded_adapter(trainer.parallelism.sharded, "a", LORA["a"][0], target)
    ids, mask = rank_batch(0, rank)
    with torch.no_grad():
        logits = trainer.forward(ids, mask, outputs=("logits",), checkpoint="a").logits
    if rank != 0:
        return {}
    loaded = PeftModel.from_pretrained(copy.deepcopy(master), str(target)).eval()
    with torch.no_grad():
        peft_logits = compute_outputs(loaded, {}, ForwardCall(ids, mask, None, None, ("logits",), 0, None))["logits"]
        base_logits = compute_outputs(master, {}, ForwardCall(ids, mask, None, None, ("logits",), 0, None))["logits"]
    return dict(
        peft_logits_bitwise=bitwise(peft_logits, logits),
        peft_logits_max_diff=max_diff(peft_logits, logits),
        adapter_moves_logits=max_diff(base_logits, logits),
    )


def check_stale(rank, world_size, mesh):
    """Forward A, step on B, backward A: the adapter's gradient at A's forward-time weights; the snapshot holds
    only the adapter's shards (the frozen base is never stale)."""
    master = tiny_qwen3(vocab=VOCAB)
    expected = Reference(master, ["a"], torch.float32).grads("a", 1, world_size)["a"]
    results = {}
    for mode in ("retain", "replay"):
        trainer = sharded_lora_trainer(master, mesh, ["a"])
        ids, mask = rank_batch(1, rank)
        out = trainer.forward(ids, mask, mode=mode, checkpoint="a")
        backward_on(trainer, 2, rank, world_size)
        trainer.step()
        held = trainer.graphs.held_weight_bytes(trainer._parameter_storages())
        trainer.backward(token_loss(out.logprobs, mask, 1, world_size))
        assert isinstance(trainer.parallelism, FullyShard)
        adapter = [p for _, p in adapter_parameters(trainer.model, "a")]
        shards = sum(fp._sharded_param_data.numel() * 4 for fp in trainer.parallelism.sharded.fsdp_params(adapter))
        got = grads(trainer, "a")
        results[mode] = {
            "bitwise": all_bitwise(got, expected),
            "max_diff": worst(got, expected),
            "held": held,
            "shards": shards,
        }
    emit("stale", rank, modes=results)


def check_two_adapters(rank, world_size, mesh):
    """Adapters 'a' and 'b' trained in turn (a, b, a), each forward with its own adapter active."""
    master = tiny_qwen3(vocab=VOCAB)
    reference = Reference(master, ["a", "b"], torch.float32)
    trainer = sharded_lora_trainer(master, mesh, ["a", "b"])
    init = all(all_bitwise(weights(trainer, n), reference.masters[n]) for n in ("a", "b"))
    grad_ok, steps = [], []
    for which, adapter in ((1, "a"), (2, "b"), (3, "a")):
        expected = reference.grads(adapter, which, world_size)
        backward_on(trainer, which, rank, world_size, adapter=adapter)
        other = "b" if adapter == "a" else "a"
        grad_ok.append(all_bitwise(grads(trainer, adapter), expected[adapter]) and not grads(trainer, other))
        reports = trainer.step()
        steps.append([reports[adapter].stepped, reports[other].stepped])
        reference.step(expected)
    final = {n: all_bitwise(weights(trainer, n), reference.masters[n]) for n in ("a", "b")}
    emit("two_adapters", rank, init=init, grads=grad_ok, steps=steps, weights=final)


def check_head(rank, world_size, mesh):
    """A value head (replicated) beside adapter 'a' over the sharded frozen base: one step of both vs the reference."""
    master = tiny_qwen3(vocab=VOCAB)
    torch.manual_seed(3)
    head = torch.nn.Linear(master.config.hidden_size, 1)
    reference = Reference(master, ["a"], torch.float32, head=head)
    trainer = sharded_lora_trainer(master, mesh, ["a"], head=head)
    expected = reference.grads("a", 1, world_size)
    ids, mask = rank_batch(1, rank)
    out = trainer.forward(ids, mask, outputs=("logprobs", "heads"), mode="retain", checkpoint="a")
    trainer.backward(token_loss(out.logprobs, mask, 1, world_size) + out.heads["value"].pow(2).sum() / 100)
    found = {"a": grads(trainer, "a"), "value": grads(trainer, "value")}
    trainer.step()
    reference.step(expected)
    emit(
        "head",
        rank,
        grads={c: all_bitwise(found[c], expected[c]) for c in found},
        weights={c: all_bitwise(weights(trainer, c), reference.masters[c]) for c in found},
    )


def check_refusals(rank, world_size, mesh):
    master = tiny_qwen3(vocab=VOCAB)
    trainer = sharded_lora_trainer(master, mesh, ["a"])
    other = LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj"])
    messages = []
    for attempt in (
        lambda: trainer.add_lora_checkpoint("b", LORA["b"][0]),  # never injected
        lambda: trainer.add_base_checkpoint(),  # the base was frozen before sharding
        lambda: inject_lora(trainer.model, "a", other),  # the name is taken
    ):
        try:
            attempt()
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    model = copy.deepcopy(master)
    inject_lora(model, "a", LORA["a"][0])
    fresh = Trainer(model, parallelism=FullyShard(shard_model(model, mesh)))
    try:
        fresh.add_lora_checkpoint("a", other)
        messages.append(None)
    except ValueError as error:
        messages.append(str(error))
    emit("refusals", rank, messages=messages)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    rank, world_size, mesh = start()
    check_steps(rank, world_size, mesh, torch.float32, "fp32", out)
    check_steps(rank, world_size, mesh, torch.bfloat16, "bf16", None)
    check_stale(rank, world_size, mesh)
    check_two_adapters(rank, world_size, mesh)
    check_head(rank, world_size, mesh)
    check_refusals(rank, world_size, mesh)


if __name__ == "__main__":
    run_rank_process(main)
