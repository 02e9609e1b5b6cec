"""The trainer's device-specific paths, on every device this machine has: offload, replay's RNG, the planner's clocks.

On a CPU-only machine the `cuda` cases skip and the `cpu` cases run; on a GPU
machine `python -m bench.gpu_suite` runs them all (pinned host offload, the
CUDA RNG replayed, CUDA-event timings; bf16 on the GPU is
`test_optimizer_step.py`'s). Tensors are placed on the device under test; the
references are plain autograd on a copy there.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.trainer.models import DEVICES, batch, tiny_qwen3
from tests.trainer.test_backward_state import assert_same_grads, reference_logprobs, sft_loss
from trainer_core.training import MemoryPlanner, Trainer


def on(device: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in tensors)


def tolerance(device: str) -> dict:
    # CUDA's embedding and index backward accumulate with atomics: the order of float additions varies.
    return {"rtol": 1e-5, "atol": 1e-7} if device == "cpu" else {"rtol": 1e-4, "atol": 1e-6}


@pytest.mark.parametrize("device", DEVICES)
def test_offload_moves_saved_tensors_off_the_device_and_back(device):
    ids, mask = on(device, *batch())
    model = tiny_qwen3().train().to(device)
    reference = copy.deepcopy(model)
    trainer = Trainer(model, planner=MemoryPlanner(budget_bytes=10**12))  # a budget: the copies are timed
    trainer.add_base_checkpoint()
    out = trainer.forward(ids, mask, mode="offload")
    graph = trainer.graphs.get(out.graph_id)
    hooks = graph.state.offload_hooks
    assert trainer.offload_target == ("host" if device == "cuda" else "disk")
    assert graph.saved_bytes == 0 and hooks.offloaded_bytes > 0  # nothing resident on the device
    if device == "cuda":  # pinned host copies, so the way back is an asynchronous DMA
        host_copies = [packed[2] for _, _, packed in hooks._packed.values() if packed[0] == "host"]
        assert host_copies and all(t.is_pinned() and t.device.type == "cpu" for t in host_copies)
    trainer.backward(sft_loss(out.logprobs, mask))
    sft_loss(reference_logprobs(reference, ids, mask), mask).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name, **tolerance(device))
    planner = trainer.planner
    assert planner.pack_s_per_byte > 0 and planner.restore_s_per_byte > 0  # timed on the copies (CUDA events)


@pytest.mark.parametrize("device", DEVICES)
def test_replay_draws_the_forwards_dropout_masks_from_the_devices_rng(device):
    ids, mask = on(device, *batch())
    model = tiny_qwen3(dropout=0.3).train().to(device)
    reference = copy.deepcopy(model)
    trainer = Trainer(model)
    trainer.add_base_checkpoint()
    torch.manual_seed(5)  # seeds the CPU and every CUDA generator
    out = trainer.forward(ids, mask, mode="replay")
    torch.manual_seed(1234)  # the generators move on before the backward, as in real use
    torch.rand(1000, device=device)
    trainer.backward(sft_loss(out.logprobs, mask))
    torch.manual_seed(5)
    sft_loss(reference_logprobs(reference, ids, mask), mask).backward()
    if device == "cpu":
        assert_same_grads(model, reference)
    else:
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name, **tolerance(device))


@pytest.mark.parametrize("device", DEVICES)
def test_the_planner_times_forwards_and_copies_on_the_device(device):
    ids, mask = on(device, *batch(size=4, length=24))
    trainer = Trainer(tiny_qwen3().train().to(device), planner=MemoryPlanner(budget_bytes=1))
    trainer.add_base_checkpoint()
    modes = []
    for _ in range(3):
        out = trainer.forward(ids, mask)
        modes.append(trainer.graphs.get(out.graph_id).mode)
        trainer.backward(sft_loss(out.logprobs, mask))
    planner = trainer.planner
    assert modes[0] == "offload" and set(modes[1:]) <= {"offload", "replay"}
    assert planner.forward_s_per_token > 0 and planner.pack_s_per_byte > 0 and planner.restore_s_per_byte > 0
    assert trainer.peak_saved_bytes <= ids.numel() * 8 * 2  # at most a replay's input copies: nothing else stays
