"""A head in another dtype than the model computes in is refused when it is registered, naming it and the fix.

Without the check an FP32 head on a bf16 model failed in its first forward with torch's own error ("mat1 and mat2
must have the same dtype"). Under a sharded bf16 policy the weights are FP32 (the masters) but the hidden states
bf16: the check asks FSDP for the compute dtype (W = 1, one gloo process in this test's own process group).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.trainer.models import batch, tiny_qwen3
from trainer_core.parallel import FullyShard
from trainer_core.parallel.fsdp.shard import shard_model
from trainer_core.training import Trainer

HIDDEN = 32


def test_an_fp32_head_on_a_bf16_model_is_refused_naming_it_and_the_fix():
    trainer = Trainer(tiny_qwen3(dtype=torch.bfloat16))
    head = torch.nn.Linear(HIDDEN, 1)
    with pytest.raises(
        ValueError, match=r"head 'value': its parameter weight is torch\.float32, .*torch\.bfloat16"
    ) as e:
        trainer.add_module_checkpoint("value", head)
    assert "module.to(torch.bfloat16)" in str(e.value)
    assert "value" not in trainer.checkpoints and head.weight.dtype == torch.float32  # nothing changed


def test_the_head_built_in_bf16_trains_through_masters():
    trainer = Trainer(tiny_qwen3(dtype=torch.bfloat16))
    trainer.add_module_checkpoint("value", torch.nn.Linear(HIDDEN, 1).to(torch.bfloat16))
    ids, mask = batch()
    out = trainer.forward(ids, mask, outputs=("heads",))
    trainer.backward(out.heads["value"].float().pow(2).mean())
    trainer.step()
    assert out.heads["value"].dtype == torch.bfloat16
    assert set(trainer.checkpoints["value"].master_weights()) == {"weight", "bias"}


@pytest.fixture
def one_process_group():
    store = dist.HashStore()  # pyright: ignore[reportPrivateImportUsage] - public, missing from __all__
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)  # as training_mesh makes it for one process
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_under_a_sharded_bf16_policy_the_fp32_head_is_refused_and_a_bf16_one_runs(one_process_group):
    model = tiny_qwen3()  # FP32 weights: the masters; bf16 the all-gather and the compute
    trainer = Trainer(model, parallelism=FullyShard(shard_model(model, one_process_group, param_dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match=r"head 'value': .* torch\.float32, and the model computes in torch\.bfloat16"):
        trainer.add_module_checkpoint("value", torch.nn.Linear(HIDDEN, 1))
    trainer.add_module_checkpoint("value", torch.nn.Linear(HIDDEN, 1).to(torch.bfloat16))
    ids, mask = batch()
    with torch.no_grad():
        out = trainer.forward(ids, mask, outputs=("heads",))
    assert out.heads["value"].dtype == torch.bfloat16
