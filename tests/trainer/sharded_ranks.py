"""Helpers for the FSDP2 tests: the rank side (mesh, references, one JSON result line per check) and the launch.

A worker runs every check of its test module in one torchrun launch and prints
`RESULT {"check": ..., "rank": ..., ...}` per check and rank; the test module
launches it once per world size (module-scoped fixture) and asserts per check.
Each check compares the sharded model with an independent reference built on
every rank: the unsharded model (or plain autograd / `torch.optim.AdamW` on a
full FP32 copy), fed every rank's batch in rank order.
"""

from __future__ import annotations

import copy
import json
import os

import torch
import torch.nn.functional as F

from infra.launch.launcher import launch
from tests.trainer.models import batch
from tests.trainer.ranks import ROOT

RESULT = "RESULT "
VOCAB = 97


def launches_with_out(module: str, world_sizes: list[int], tmp_path_factory) -> dict[int, dict]:
    """`launch_results` of `module` at each world size, each launch given `--out` a fresh directory of its own."""
    return {w: launch_results(module, w, ["--out", str(tmp_path_factory.mktemp(f"w{w}"))]) for w in world_sizes}


def launch_results(module: str, world_size: int, args: list[str] | None = None) -> dict[tuple[str, int], dict]:
    """Run `module` on `world_size` gloo ranks; {(check, rank): result}. Fails the test unless every rank exits 0."""
    lines: list[str] = []
    result = launch(
        module,
        args or [],
        nproc_per_node=world_size,
        timeout_s=300,
        env={"PYTHONPATH": str(ROOT)},
        on_line=lines.append,
    )
    assert result.returncode == 0, "\n".join(lines[-60:])
    results = {}
    for line in lines:
        if RESULT in line:
            record = json.loads(line.split(RESULT, 1)[1])
            results[(record["check"], record["rank"])] = record
    return results


def each_rank(runs: dict[int, dict], world_size: int, check: str) -> list[dict]:
    """Check `check`'s result on every rank of the `world_size` launch, in rank order; fails if a rank has none."""
    found = [runs[world_size].get((check, rank)) for rank in range(world_size)]
    assert all(found), (check, world_size, sorted(runs[world_size]))
    return found  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------- rank side


def start():
    """Join the process group (one thread per rank) and return (rank, world_size, a 1-D CPU mesh over all ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    from trainer_core.ranks import pin_threads
    from trainer_core.run.distributed import init_distributed

    pin_threads(1)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    topology = init_distributed(logical_dp=world_size, timeout_s=120)
    if not torch.distributed.is_initialized():  # W = 1 under torchrun: FSDP still needs a process group
        torch.distributed.init_process_group("gloo")
    return topology.rank, world_size, init_device_mesh("cpu", (world_size,))


def emit(check: str, rank: int, **values) -> None:
    from trainer_core.run.distributed import log

    log(RESULT + json.dumps({"check": check, "rank": rank, **values}))


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered (collective), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN-safe, -0.0 vs 0.0 told apart)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.detach().contiguous().view(ints), b.detach().contiguous().view(ints))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().double() - b.detach().double()).abs().max().item()


def rank_batch(which: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return batch(seed=100 * which + rank, vocab=VOCAB)


def num_tokens(which: int, world_size: int) -> int:
    """The global count of predicted tokens of batch `which`: every rank's loss is divided by it (a sum over ranks)."""
    return sum(int(rank_batch(which, r)[1][:, 1:].sum()) for r in range(world_size))


def loss(model, which: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's share of the global mean token loss: summed CE over its unmasked targets / the global count."""
    ids, mask = rank_batch(which, rank)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    per_token = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="none")
    return (per_token * mask[:, 1:].reshape(-1)).sum() / num_tokens(which, world_size)


def summed_grads(reference, which: int, world_size: int) -> dict[str, torch.Tensor]:
    """Plain autograd on the unsharded `reference`: each rank's gradient, cast to FP32 and summed in rank order."""
    total: dict[str, torch.Tensor] = {}
    for r in range(world_size):
        reference.zero_grad(set_to_none=True)
        loss(reference, which, r, world_size).backward()
        for name, p in reference.named_parameters():
            g = p.grad.float()
            total[name] = g.clone() if name not in total else total[name] + g
    reference.zero_grad(set_to_none=True)
    return total


def gathered(model) -> dict[str, torch.Tensor]:
    """Every parameter of a sharded model, whole (collective)."""
    return {name: full(p.detach()) for name, p in model.named_parameters()}


def gathered_grads(model) -> dict[str, torch.Tensor]:
    return {name: full(p.grad) for name, p in model.named_parameters()}


def all_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(bitwise(a[k], b[k]) for k in a)


def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(max_diff(a[k], b[k]) for k in a)


def bf16_reference(master):
    """The unsharded trainer's bf16 model from FP32 masters: weights cast, RoPE's inv_freq kept FP32 (from_config's)."""
    model = copy.deepcopy(master).to(torch.bfloat16)
    rotary = model.model.rotary_emb
    rotary.inv_freq = master.model.rotary_emb.inv_freq.clone()
    return model
