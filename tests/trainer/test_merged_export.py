"""A merged LoRA export (`save_hf_model(..., merge_adapter=NAME)`) against peft's own `merge_and_unload`, per variant.

Each variant the trainer API accepts is trained for two steps (so DoRA's
magnitudes move away from the base weights' norms), exported as a peft
adapter and as merged full weights. The reference loads the adapter onto an
untouched copy of the base with `PeftModel.from_pretrained` and merges it with
peft's `merge_and_unload`; the merged export must give its logits.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM

from tests.trainer.models import batch, tiny_qwen3
from tests.trainer.test_backward_state import sft_loss
from trainer_core.training import OptimizerConfig, Trainer, export_checkpoint_module, save_hf_model

TARGETS = ["q_proj", "v_proj", "down_proj"]
VARIANTS = {
    "lora": dict(),
    "rslora": dict(use_rslora=True),
    "dora": dict(use_dora=True),
}


def trained(variant: str, dtype=torch.float32):
    base = tiny_qwen3(dtype=dtype).train()
    pristine = copy.deepcopy(base)
    trainer = Trainer(base)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, **VARIANTS[variant])
    trainer.add_lora_checkpoint("adapter", config, optimizer=OptimizerConfig(learning_rate=3e-2))
    for seed in range(2):
        ids, mask = batch(seed=seed)
        trainer.backward(sft_loss(trainer.forward(ids, mask).logprobs, mask))
        trainer.step()
    return trainer, pristine


def logits(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_merged_export_gives_peft_merge_and_unload_logits(tmp_path, variant):
    trainer, pristine = trained(variant)
    ids, mask = batch(seed=5)
    live = {name: param.detach().clone() for name, param in trainer.model.named_parameters()}
    export_checkpoint_module(trainer, "adapter", tmp_path / "adapter")
    save_hf_model(trainer.model, tmp_path / "merged", merge_adapter="adapter")

    reference = PeftModel.from_pretrained(copy.deepcopy(pristine), str(tmp_path / "adapter")).merge_and_unload()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), local_files_only=True)
    expected = logits(reference, ids, mask)
    torch.testing.assert_close(logits(merged, ids, mask), expected, rtol=0, atol=1e-6)
    # The same weights as peft's merge, bit for bit (the same computation, on the same tensors).
    reference_state = reference.state_dict()
    for name, tensor in merged.state_dict().items():
        assert torch.equal(tensor, reference_state[name]), name
    # The merge is worth testing: it changed the model, and the trainer's own adapter forward agrees with it.
    assert (expected - logits(pristine, ids, mask)).abs().max() > 1e-3
    torch.testing.assert_close(logits(trainer.model, ids, mask), expected, rtol=0, atol=1e-5)
    # Exporting merged left the live model as it was (no merge in place, no unmerge rounding).
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param, live[name]), name


def test_a_variant_peft_cannot_merge_is_refused_before_anything_is_written(tmp_path):
    trainer = Trainer(tiny_qwen3().train())
    trainer.add_lora_checkpoint("adapter", LoraConfig(r=4, target_modules=["q_proj"], alora_invocation_tokens=[5, 6]))
    with pytest.raises(
        ValueError,
        match=r"adapter 'adapter' cannot be merged into the base weights .*aLoRA.*export it "
        r"unmerged",
    ):
        save_hf_model(trainer.model, tmp_path / "merged", merge_adapter="adapter")
    assert not (tmp_path / "merged").exists()


def test_merging_an_adapter_no_layer_holds_is_refused(tmp_path):
    trainer, _ = trained("lora")
    with pytest.raises(ValueError, match="no LoRA layer holds an adapter named 'other'"):
        save_hf_model(trainer.model, tmp_path / "merged", merge_adapter="other")


@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_a_bfloat16_merge_is_peft_merge_in_float32_rounded_once(tmp_path, variant):
    """In bf16, peft's merge would round ΔW to bf16 before adding it; the export merges in float32, then rounds."""
    trainer, pristine = trained(variant, torch.bfloat16)
    export_checkpoint_module(trainer, "adapter", tmp_path / "adapter")
    save_hf_model(trainer.model, tmp_path / "merged", merge_adapter="adapter")
    peft_model = PeftModel.from_pretrained(copy.deepcopy(pristine), str(tmp_path / "adapter"))
    reference = peft_model.float().merge_and_unload().to(torch.bfloat16)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), local_files_only=True)
    reference_state = reference.state_dict()
    for name, tensor in merged.state_dict().items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, reference_state[name]), name
    ids, mask = batch(seed=5)
    assert (logits(merged, ids, mask).float() - logits(pristine, ids, mask).float()).abs().max() > 1e-2
