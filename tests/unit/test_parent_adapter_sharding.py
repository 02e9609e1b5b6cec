"""Continuing a committed LoRA adapter is refused under every parallelism that shards the weights, by its name."""

from __future__ import annotations

import pytest

from infra.publication.parent_adapter import continue_adapter
from tests.conftest import tiny_tree
from trainer_core.config import config_from_dict
from trainer_core.errors import ConfigError


@pytest.mark.parametrize("sharding", ["fsdp", "hsdp"])
def test_an_adapter_is_not_continued_on_sharded_weights(tmp_path, sharding):
    checkpoint = tmp_path / "parent"
    (checkpoint / "base").mkdir(parents=True)
    (checkpoint / "base" / "config.json").write_text("{}")
    config = config_from_dict(tiny_tree(tmp_path, train={"sharding": sharding}), config_dir=tmp_path)
    with pytest.raises(ConfigError) as refused:
        continue_adapter(config, checkpoint, "model.path")
    assert str(refused.value) == (
        f'model.path is a LoRA adapter checkpoint, and continuing an adapter with train.sharding = "{sharding}" '
        'is not supported yet; set train.sharding = "none" to continue it'
    )


@pytest.mark.parametrize("sharding", ["fsdp", "hsdp"])
def test_the_config_refuses_an_adapter_that_continues_on_sharded_weights(tmp_path, sharding):
    lora = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj"], "init_from": str(tmp_path / "adapter")}
    tree = tiny_tree(tmp_path, train={"sharding": sharding}, model={"lora": lora})
    with pytest.raises(ConfigError, match="not supported yet") as refused:
        config_from_dict(tree, config_dir=tmp_path)
    assert (
        "a LoRA adapter that continues (model.lora.init_from, or model.path naming a LoRA checkpoint) with "
        f'train.sharding = "{sharding}": not supported yet; set train.sharding = "none" to continue it'
    ) in str(refused.value)
