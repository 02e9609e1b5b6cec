"""Several LoRA adapters on one model: each forward runs the adapter it names, as peft runs its active adapter.

The reference is plain autograd on a copy of the model with the same adapters
injected, switched with peft's own `set_adapter` before each forward.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.tuners_utils import set_adapter

from tests.trainer.models import batch, tiny_qwen3
from tests.trainer.test_backward_state import MODES, reference_logprobs, sft_loss
from trainer_core.training import OptimizerConfig, Trainer

LORA_A = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1, init_lora_weights=False)
LORA_B = LoraConfig(r=2, lora_alpha=4, target_modules=["k_proj", "v_proj", "down_proj"], init_lora_weights=False)


def two_adapters(with_base: bool = False):
    model = tiny_qwen3(dropout=0.1).train()
    reference = copy.deepcopy(model)
    trainer = Trainer(model)
    if with_base:
        trainer.add_base_checkpoint()
    for name, config, seed in (("a", LORA_A, 1), ("b", LORA_B, 2)):
        torch.manual_seed(seed)
        trainer.add_lora_checkpoint(name, config, optimizer=OptimizerConfig(learning_rate=1e-2))
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")  # a second adapter, on purpose
            inject_adapter_in_model(config, reference, adapter_name=name)
    return trainer, reference


def reference_loss(reference, adapter: str, ids, mask, seed: int, with_base: bool) -> torch.Tensor:
    set_adapter(reference, adapter)  # peft's switch: the others stop running (and stop requiring grad)
    if with_base:
        for name, param in reference.named_parameters():
            if "lora_" not in name:
                param.requires_grad_(True)
    torch.manual_seed(seed)
    return sft_loss(reference_logprobs(reference, ids, mask), mask)


@pytest.mark.parametrize("with_base", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_each_adapters_gradient_is_plain_autograd_with_that_adapter_active(mode, with_base):
    trainer, reference = two_adapters(with_base)
    (ids_a, mask_a), (ids_b, mask_b) = batch(seed=1), batch(seed=2)
    torch.manual_seed(11)
    out_a = trainer.forward(ids_a, mask_a, mode=mode, checkpoint="a")
    torch.manual_seed(12)
    out_b = trainer.forward(ids_b, mask_b, mode=mode, checkpoint="b")  # "a" is no longer active when it backwards
    assert set(out_a.versions) == ({"base"} if with_base else set()) | {"a"}
    torch.manual_seed(99)
    trainer.backward(sft_loss(out_a.logprobs, mask_a) + 0.5 * sft_loss(out_b.logprobs, mask_b))
    reference_loss(reference, "a", ids_a, mask_a, 11, with_base).backward()
    (0.5 * reference_loss(reference, "b", ids_b, mask_b, 12, with_base)).backward()
    live = dict(trainer.model.named_parameters())
    assert sorted(live) == sorted(n for n, _ in reference.named_parameters())
    for name, expected in reference.named_parameters():
        if "lora_" in name or with_base:
            assert live[name].grad is not None, name
            torch.testing.assert_close(live[name].grad, expected.grad, rtol=1e-5, atol=1e-7, msg=name)
        else:
            assert live[name].grad is None, name


@pytest.mark.parametrize("mode", ["retain", "replay"])
def test_one_adapters_steps_do_not_age_the_others_graphs(mode):
    trainer, reference = two_adapters()
    ids, mask = batch(seed=3)
    torch.manual_seed(0)
    held = trainer.forward(ids, mask, mode=mode, checkpoint="a")
    for _ in range(3):  # past max_gradient_staleness=2 if "b"'s steps counted for "a"
        out = trainer.forward(ids, mask, checkpoint="b")
        trainer.backward(sft_loss(out.logprobs, mask))
        reports = trainer.step()
        assert reports["b"].stepped and not reports["a"].stepped and reports["a"].skipped_reason == "no gradient"
    report = trainer.backward(sft_loss(held.logprobs, mask))
    assert report.ages[held.graph_id] == {"a": 0}
    reference_loss(reference, "a", ids, mask, 0, False).backward()
    live = dict(trainer.model.named_parameters())
    for name, expected in reference.named_parameters():
        if ".a." in name:
            torch.testing.assert_close(live[name].grad, expected.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_the_selection_is_named_and_checked():
    trainer, _ = two_adapters(with_base=True)
    ids, mask = batch()
    with pytest.raises(ValueError, match=r"2 LoRA adapters are registered \(a, b\); .*checkpoint=NAME"):
        trainer.forward(ids, mask)
    with pytest.raises(ValueError, match="'base' checkpoint; forward\\(checkpoint=\\) selects a LoRA adapter"):
        trainer.forward(ids, mask, checkpoint="base")
    with pytest.raises(ValueError, match="checkpoint='c' is not registered"):
        trainer.forward(ids, mask, checkpoint="c")
    with pytest.raises(ValueError, match="a checkpoint named 'a' is already registered"):
        trainer.add_lora_checkpoint("a", LORA_B)


def test_a_single_adapter_needs_no_selection():
    trainer = Trainer(tiny_qwen3().train())
    trainer.add_lora_checkpoint("only", LORA_A)
    ids, mask = batch()
    out = trainer.forward(ids, mask)
    assert set(out.versions) == {"only"}
