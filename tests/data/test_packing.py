"""Packed rows give the same per-token logprobs as unpacked ones: no attention leaks across documents."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import EXAMPLES, tiny_tree
from trainer_core.config import config_from_dict
from trainer_core.data import packed_attention_inputs
from trainer_core.run.plan import build_plan


def tiny_model(attn_implementation: str) -> torch.nn.Module:
    config = AutoConfig.for_model(**json.loads((EXAMPLES / "tiny" / "model_config.json").read_text()))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()


def target_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(input_ids[t] | prefix) for t >= 1, from the logits at t-1 (the shard's target convention)."""
    return logits[:-1].double().log_softmax(-1).gather(-1, input_ids[1:, None])[:, 0]


@pytest.fixture(scope="module")
def packed_shard(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("packed")
    config = config_from_dict(
        tiny_tree(
            tmp_path,
            train={"steps": 2, "steps_per_segment": 2, "global_batch_size": 4, "logical_dp": 1, "nproc_per_node": 1},
            data={"pack": True},
        ),
        config_dir=tmp_path,
    )
    plan, shards = build_plan(config)
    assert plan.packed
    return shards[0]


@pytest.mark.parametrize("mode", ["position_ids", "mask"])
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_rows_give_the_unpacked_logprobs(packed_shard, attn_implementation, mode):
    model = tiny_model(attn_implementation)
    input_ids, position_ids, document_ids, loss_mask = (
        packed_shard[k][0] for k in ("input_ids", "position_ids", "document_ids", "loss_mask")
    )
    assert int(document_ids.max()) >= 3, "the rows must hold several documents for this test to mean anything"
    with torch.no_grad():
        packed_logits = model(**packed_attention_inputs(input_ids, position_ids, document_ids, mode=mode)).logits
        leaky_logits = model(input_ids=input_ids).logits  # a plain causal mask over the whole row
        compared = worst_leak = 0
        for row in range(input_ids.shape[0]):
            packed = target_logprobs(packed_logits[row], input_ids[row])
            leaky = target_logprobs(leaky_logits[row], input_ids[row])
            for document in range(1, int(document_ids[row].max()) + 1):
                positions = torch.nonzero(document_ids[row] == document)[:, 0]
                tokens = input_ids[row, positions]
                alone = target_logprobs(model(input_ids=tokens[None]).logits[0], tokens)
                # targets inside the document: every position after its first token
                inside = positions[1:] - 1
                torch.testing.assert_close(packed[inside], alone, atol=1e-5, rtol=0)
                assert not loss_mask[row, positions[0]]
                if document > 1:
                    worst_leak = max(worst_leak, float((leaky[inside] - alone).abs().max()))
                compared += len(inside)
    assert compared > 100
    assert worst_leak > 1e-2  # without the packed inputs, later documents would see earlier ones


def test_packing_wastes_less_than_padding_and_keeps_every_loss_token(tmp_path):
    config = config_from_dict(tiny_tree(tmp_path), config_dir=tmp_path)
    _, unpacked = build_plan(config)
    config.data.pack = True
    _, packed = build_plan(config)
    for shards in (unpacked, packed):
        for tensors in shards.values():
            assert not tensors["loss_mask"][..., 0].any()
            assert (tensors["loss_mask"] <= tensors["attention_mask"]).all()
    pad_fraction = [1 - float(s[0]["attention_mask"].float().mean()) for s in (unpacked, packed)]
    assert pad_fraction[1] < pad_fraction[0]
    assert set(packed[0]) == {"input_ids", "loss_mask", "attention_mask", "position_ids", "document_ids"}
    assert set(unpacked[0]) == {"input_ids", "loss_mask", "attention_mask"}
    assert packed[0]["input_ids"].shape[-1] == 128 and packed[0]["document_ids"].dtype == torch.int32
