"""The memory model's prediction against the bytes actually held (CPU: tensor bytes), within 10%.

- State, unsharded: the real Trainer (FP32 and bf16, full fine-tune and LoRA),
  measured as it applies its second optimizer step (gradients summed onto the
  optimized tensors, AdamW's moments present): the storages of the model's
  parameters, the FP32 masters, the gradients and the optimizer state.
- State, fsdp at W = 2 (gloo): `shard_model` + `torch.optim.AdamW` after one
  backward and step, every live tensor of each rank (tests/trainer/memory_fsdp_worker.py).
- Activations: what a forward saves for backward (`saved_tensors_hooks`,
  parameters excluded) on real CPU tensors, for eager and fused (sdpa)
  attention, at shapes the fit never saw (more layers, more rows, other
  lengths); with block checkpointing, the graph walk the planner uses
  (`saved_tensor_bytes`, which counts what a checkpointed layer keeps).

The prediction always comes from a meta-device model built from the config,
never from the measured object.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from transformers import Qwen3ForCausalLM

from tests.trainer.models import batch, tiny_qwen3
from tests.trainer.sharded_ranks import launch_results
from tests.trainer.test_backward_state import sft_loss
from trainer_core.memory_model import MemorySettings, predict
from trainer_core.memory_shape import activation_fit, meta_model, model_shape, saved_bytes
from trainer_core.training import Trainer
from trainer_core.training.activation_checkpointing import checkpoint_blocks
from trainer_core.training.checkpoints import Checkpoint
from trainer_core.training.memory.retained import saved_tensor_bytes

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def _storage_bytes(tensors) -> int:
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def _held_by(trainer: Trainer) -> int:
    """Storages of the model's parameters, the checkpoints' masters, every gradient and the optimizer state."""
    tensors = list(trainer.model.parameters())
    for checkpoint in trainer.checkpoints.values():
        optimized = list(checkpoint.optimized_parameters().values())
        tensors += optimized + list(checkpoint.master_weights().values())
        tensors += [t.grad for t in [*optimized, *checkpoint.parameters().values()] if t.grad is not None]
        tensors += [v for state in checkpoint.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return _storage_bytes(tensors)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_trainer_holds_the_predicted_state_bytes(monkeypatch, dtype, lora):
    model = tiny_qwen3(dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]).train()
    meta = meta_model(model.config, dtype)
    trainer = Trainer(model)
    if lora:
        trainer.add_lora_checkpoint("adapter", LoraConfig(**LORA))
        inject_adapter_in_model(LoraConfig(**LORA), meta)
    else:
        trainer.add_base_checkpoint()
    held: list[int] = []
    apply = Checkpoint.apply

    def measured_apply(self, norm, learning_rate):
        held.append(_held_by(trainer))  # gradients on the optimized tensors, before AdamW's step
        return apply(self, norm, learning_rate)

    monkeypatch.setattr(Checkpoint, "apply", measured_apply)
    ids, mask = batch()
    for _ in range(2):
        logprobs = trainer.forward(ids, mask).logprobs
        assert logprobs is not None
        trainer.backward(sft_loss(logprobs, mask))
        trainer.step()
    shape = model_shape(meta, trainable=(lambda name: "lora_" in name) if lora else (lambda name: True))
    estimate = predict(shape, activation_fit(model.config, dtype), MemorySettings("none", 1, dtype))
    assert held[1] == pytest.approx(estimate.state, rel=0.10), (held, estimate)
    if lora:  # the frozen base has no masters, moments or gradients: the adapters' alone are counted
        assert estimate.moments == 8 * sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)


def test_a_sharded_model_at_w2_holds_the_predicted_state_bytes_on_every_rank():
    results = launch_results("tests.trainer.memory_fsdp_worker", 2)
    for dtype in ("float32", "bfloat16"):
        for rank in range(2):
            found = results[(f"state_{dtype}", rank)]
            assert found["held"] == pytest.approx(found["predicted"], rel=0.10), found
            assert found["structural"] == pytest.approx(found["predicted"], rel=0.10), found


test_a_sharded_model_at_w2_holds_the_predicted_state_bytes_on_every_rank = pytest.mark.distributed(
    test_a_sharded_model_at_w2_holds_the_predicted_state_bytes_on_every_rank
)


def _qwen3(layers: int, attention: str, dtype: torch.dtype) -> Qwen3ForCausalLM:
    config = copy.deepcopy(tiny_qwen3().config)
    config.num_hidden_layers = layers
    config.layer_types = ["full_attention"] * layers
    config._attn_implementation = attention
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    torch.nn.Module.to(model, dtype)
    return model.train()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize(("rows", "length"), [(3, 24), (2, 56)])
def test_the_activation_term_is_what_a_forward_saves(attention, dtype, rows, length):
    model = _qwen3(5, attention, {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
    ids = torch.randint(3, 97, (rows, length), generator=torch.Generator().manual_seed(0))
    measured = saved_bytes(model, ids, attention_mask=torch.ones_like(ids), use_cache=False)
    settings = MemorySettings("none", 1, dtype, rows_per_logical_rank=rows, seq_len=length)
    predicted = predict(model_shape(model), activation_fit(model.config, dtype), settings).activations
    assert measured == pytest.approx(predicted, rel=0.10)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_with_block_checkpointing_the_forward_keeps_what_the_model_says(attention):
    model = _qwen3(6, attention, torch.bfloat16)
    checkpoint_blocks(model)
    ids = torch.randint(3, 97, (3, 40), generator=torch.Generator().manual_seed(0))
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    measured = saved_tensor_bytes({"logits": logits}, {p.untyped_storage().data_ptr() for p in model.parameters()})
    settings = MemorySettings(
        "none", 1, "bfloat16", activation_checkpointing="blocks", rows_per_logical_rank=3, seq_len=40
    )
    fit = activation_fit(model.config, "bfloat16")
    # The term is the forward's inputs plus the one layer backward recomputes at a time, which the forward never holds.
    forward_part = predict(model_shape(model), fit, settings).activations - 3 * fit.layer(40)
    assert measured == pytest.approx(forward_part, rel=0.10)
    plain = MemorySettings("none", 1, "bfloat16", rows_per_logical_rank=3, seq_len=40)
    assert predict(model_shape(model), fit, settings).activations < predict(model_shape(model), fit, plain).activations
