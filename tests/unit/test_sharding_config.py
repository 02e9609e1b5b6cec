"""`train.sharding`: absent from the digest at its default "none", part of it under "fsdp"; refused combinations."""

import pytest

from tests.conftest import EXAMPLES, tiny_tree
from trainer_core.config import config_from_dict, load_config
from trainer_core.errors import ConfigError
from trainer_core.model_config import read_model_config
from trainer_core.run.device_memory import check_device_memory
from trainer_core.run.plan import digest_view


def _config(tmp_path, *overrides: str):
    return load_config(
        EXAMPLES / "tiny_sft.toml",
        [f"run.work_dir={tmp_path / 'work'}", f"storage.url={tmp_path / 'store'}", *overrides],
    )


def test_the_default_leaves_the_digest_as_it_was(tmp_path):
    view = digest_view(_config(tmp_path, "train.sharding=none"))
    assert "sharding" not in view["train"]


def test_fsdp_enters_the_digest(tmp_path):
    fast = digest_view(_config(tmp_path, "train.reduction=fast"))
    sharded = digest_view(_config(tmp_path, "train.reduction=fast", "train.sharding=fsdp"))
    assert sharded["train"]["sharding"] == "fsdp"
    assert {**sharded["train"], "sharding": None} == {**fast["train"], "sharding": None}


def test_fsdp_with_deterministic_reduction_is_legal_and_keeps_w_out_of_the_digest(tmp_path):
    """The deterministic fold is bitwise the same at any W (tests/ranks/test_sharded_logical_ranks.py): a run resumed
    at another W is the same run, so nproc_per_node stays out of its digest, as it does unsharded."""
    one, two = (_config(tmp_path, "train.sharding=fsdp", f"train.nproc_per_node={w}") for w in (1, 2))
    assert (one.train.sharding, one.train.reduction) == ("fsdp", "deterministic")
    assert digest_view(one) == digest_view(two) and "nproc_per_node" not in digest_view(one)["train"]
    assert digest_view(one)["train"]["sharding"] == "fsdp"  # the state format differs from an unsharded run's


def test_fsdp_with_a_lora_adapter_is_legal(tmp_path):
    config = _config(
        tmp_path,
        "train.sharding=fsdp",
        "train.reduction=fast",
        "model.lora.rank=4",
        "model.lora.alpha=8",
        'model.lora.target_modules=["q_proj"]',
    )
    assert config.train.sharding == "fsdp" and config.model.lora is not None


def test_fsdp_at_one_process_is_legal(tmp_path):
    config = _config(tmp_path, "train.sharding=fsdp", "train.reduction=fast", "train.nproc_per_node=1")
    assert config.train.sharding == "fsdp"


def _past_memory(tmp_path, **sections) -> str:
    """The device-memory refusal's message for the tiny config with `sections` merged in."""
    tree = tiny_tree(tmp_path)
    for section, values in sections.items():
        tree[section] = {**tree.get(section, {}), **values}
    tree["train"] = {**tree.get("train", {}), "device_memory_gb": 1e-6}
    config = config_from_dict(tree, config_dir=tmp_path)
    with pytest.raises(ConfigError) as refused:
        check_device_memory(config, read_model_config(config), 64)
    return str(refused.value)


def test_the_memory_refusal_offers_sharding_under_either_reduction(tmp_path):
    for reduction in ("deterministic", "fast"):  # fsdp takes both now: no reduction to switch to first
        assert 'try, in order: train.sharding = "fsdp"; [model.lora]' in _past_memory(
            tmp_path, train={"reduction": reduction}
        )


def test_the_memory_refusal_offers_sharding_to_a_lora_run_but_not_lora_again(tmp_path):
    lora = {"lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}}
    message = _past_memory(tmp_path, model=lora, train={"reduction": "fast"})
    assert 'try, in order: train.sharding = "fsdp"; train.dtype' in message, message
    assert "more processes" in message and "[model.lora]" not in message, message


def test_hsdp_s_limits_are_refused_before_anything_launches(tmp_path):
    """HSDP's ranks would refuse these only after the rendezvous and a model build on every process (hsdp.py,
    fsdp/fold.py); the config refuses them first, naming the fix."""
    with pytest.raises(ConfigError, match=r"train.nproc_per_node = 2 or more"):
        _config(tmp_path, "train.sharding=hsdp", "train.nnodes=2", "train.nproc_per_node=1")
    fast = _config(tmp_path, "train.sharding=hsdp", "train.nnodes=2", "train.nproc_per_node=1", "train.reduction=fast")
    assert (fast.train.sharding, fast.train.nnodes) == ("hsdp", 2)  # the engine's own reduce has no such limit
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    tree = tiny_tree(tmp_path)
    tree["model"] = {"path": str(model_dir)}
    tree["train"] = {**tree["train"], "sharding": "hsdp"}
    with pytest.raises(ConfigError, match=r'model.path with train.sharding = "hsdp".*train.sharding = "fsdp"'):
        config_from_dict(tree, config_dir=tmp_path)
    tree["train"]["sharding"] = "fsdp"
    assert config_from_dict(tree, config_dir=tmp_path).model.path is not None
