"""The memory planner: retain within the budget, then the cheaper of offload and replay."""

from __future__ import annotations

import torch

from tests.trainer.models import batch, tiny_qwen3
from tests.trainer.test_backward_state import sft_loss
from trainer_core.training import MemoryPlanner, Trainer


def test_no_budget_always_retains():
    assert MemoryPlanner().choose(num_tokens=10**6, resident_bytes=10**12) == "retain"


def test_past_the_budget_the_cheaper_measured_strategy_wins():
    planner = MemoryPlanner(budget_bytes=1000, retained_bytes_per_token=10.0)
    assert planner.choose(num_tokens=50, resident_bytes=0) == "retain"  # 500 bytes fit
    planner.offload_bytes_per_s, planner.forward_s_per_token = 1e6, 1e-3
    # 1,000 tokens → 10 kB: offload costs 2 × 10 kB / 1 MB/s = 0.02 s, replay 1 s.
    assert planner.choose(num_tokens=1000, resident_bytes=900) == "offload"
    planner.offload_bytes_per_s = 1e3  # a slow disk: offload now costs 20 s
    assert planner.choose(num_tokens=1000, resident_bytes=900) == "replay"


def test_auto_mode_keeps_resident_saved_bytes_within_the_budget_and_gradients_exact():
    ids, mask = batch(size=2, length=24)
    probe = Trainer(tiny_qwen3().train())
    probe.add_base_checkpoint()
    one_graph = (probe.forward(ids, mask, mode="retain"), probe.graphs.resident_saved_bytes())[1]
    budget = int(1.5 * one_graph)  # room for one retained graph, not two
    trainer = Trainer(tiny_qwen3().train(), planner=MemoryPlanner(budget_bytes=budget))
    trainer.add_base_checkpoint()
    outs = [trainer.forward(ids, mask) for _ in range(4)]
    modes = [trainer.graphs.get(o.graph_id).mode for o in outs]
    assert modes[0] == "retain" and set(modes[1:]) <= {"offload", "replay"}
    assert trainer.peak_saved_bytes <= budget
    trainer.backward(sum(sft_loss(o.logprobs, mask) for o in outs))
    reference = Trainer(tiny_qwen3().train())
    reference.add_base_checkpoint()
    reference.backward(4 * sft_loss(reference.forward(ids, mask, mode="retain").logprobs, mask))
    for p, q in zip(trainer.model.parameters(), reference.model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
