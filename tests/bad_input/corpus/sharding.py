"""Bad-input cases: `train.sharding = "fsdp"` where the pipeline cannot shard (trainer_core/config.py, model_checks)."""

from __future__ import annotations

import json

from .common import Case

# A causal LM with no `_no_split_modules` and no `model.model.layers`: FSDP finds no decoder layer to shard.
_NO_LAYERS = json.dumps(
    {"model_type": "openai-gpt", "vocab_size": 1024, "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 512}
)

CASES: list[Case] = [
    Case(
        "fsdp_sharding_unknown",
        "config-value",
        r"train\.sharding",
        r"none|fsdp",
        config={"train": {"sharding": "zero3"}},
    ),
    Case(
        "fsdp_model_without_layers",
        "model",
        r'train\.sharding = "fsdp": {dir}/model_config\.json builds a OpenAIGPTLMHeadModel, whose decoder layers '
        r"cannot be found",
        r'set train\.sharding = "none", or train a model with decoder layers',
        files={"model_config.json": _NO_LAYERS},
        config={"model": {"config": "{dir}/model_config.json"}, "train": {"sharding": "fsdp", "reduction": "fast"}},
    ),
]
