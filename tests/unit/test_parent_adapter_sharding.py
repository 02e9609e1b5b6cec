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
