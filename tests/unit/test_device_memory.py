"""`train.device_memory_gb` and the pre-flight memory check (trainer_core/run/device_memory.py).

The refusal through the real CLI (exit 2, one line, nothing written) is the
bad-input corpus' `model_past_device_memory` case; here: the settings a config
gives, the shape of the model it trains, the default limit, the digest, and
the table the CLI prints.
"""

from __future__ import annotations

import pytest

from flows.cli.run import print_memory
from tests.conftest import tiny_tree
from trainer_core.config import ConfigError, config_from_dict
from trainer_core.memory_model import GB
from trainer_core.model_config import read_model_config
from trainer_core.run import device_memory
from trainer_core.run.device_memory import check_device_memory, memory_settings, predict_run, run_model_shape
from trainer_core.run.plan import digest_view
from trainer_core.run.validate import validate_inputs


def _config(tmp_path, **train):
    tree = tiny_tree(tmp_path)
    tree["train"] = {**tree.get("train", {}), **train}
    return config_from_dict(tree, config_dir=tmp_path)


def test_the_key_is_operational_and_leaves_the_digest(tmp_path):
    assert digest_view(_config(tmp_path, device_memory_gb=80)) == digest_view(_config(tmp_path))


@pytest.mark.parametrize("value", [0, -1, "lots"])
def test_a_non_positive_or_non_numeric_limit_is_bad_config(tmp_path, value):
    with pytest.raises(ConfigError, match="train.device_memory_gb"):
        _config(tmp_path, device_memory_gb=value)


def test_settings_follow_the_config(tmp_path):
    config = _config(tmp_path, nproc_per_node=2, logical_dp=4, global_batch_size=16, dtype="bfloat16")
    settings = memory_settings(config, row_len=96)
    assert (settings.world_size, settings.logical_dp, settings.rows_per_logical_rank, settings.seq_len) == (2, 4, 4, 96)
    assert (settings.sharding, settings.dtype, settings.reduction) == ("none", "bfloat16", "deterministic")
    micro = _config(tmp_path, nproc_per_node=2, logical_dp=4, global_batch_size=16, micro_batch_size=3)
    assert memory_settings(micro, row_len=96).rows_per_logical_rank == 3  # one micro-batch's activations at a time
    whole = _config(tmp_path, nproc_per_node=2, logical_dp=4, global_batch_size=16, micro_batch_size=64)
    assert memory_settings(whole, row_len=96).rows_per_logical_rank == 4


def test_the_run_shape_pads_the_vocabulary_and_trains_only_the_adapter(tmp_path):
    plain = _config(tmp_path)
    model_config = read_model_config(plain)
    vocab = int(model_config.vocab_size)
    shape = run_model_shape(plain, model_config)
    assert shape.vocab_rows == vocab and shape.trainable_numel == shape.numel
    tree = tiny_tree(tmp_path)
    tree["model"] = {**tree["model"], "pad_vocab_to_multiple_of": 1000, "lora": {"target_modules": ["q_proj"]}}
    padded = run_model_shape(config_from_dict(tree, config_dir=tmp_path), model_config)
    rows = -(-vocab // 1000) * 1000
    hidden = int(model_config.hidden_size)
    assert padded.vocab_rows == rows
    assert padded.numel - padded.trainable_numel == shape.numel + 2 * (rows - vocab) * hidden  # embedding and head
    assert 0 < padded.trainable_numel < shape.numel / 10


def test_without_a_limit_or_a_cuda_device_nothing_is_checked(tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    config = _config(tmp_path)
    report = check_device_memory(config, read_model_config(config), row_len=64)
    assert report.limit_bytes is None and report.estimate.total > 0


def test_unset_the_limit_is_the_cuda_device_s_own(tmp_path, monkeypatch):
    class Properties:
        total_memory = 1000
        name = "Tiny GPU"

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_properties", lambda index: Properties())
    config = _config(tmp_path)
    with pytest.raises(ConfigError, match=r"more than the 1\.00 kB of CUDA device 0 of this machine \(Tiny GPU\)") as e:
        check_device_memory(config, read_model_config(config), row_len=64)
    assert "set train.device_memory_gb to the training GPUs' memory" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_limit_just_above_the_prediction_passes_and_just_below_is_refused(tmp_path):
    config = _config(tmp_path)
    total = predict_run(config, read_model_config(config), 64).estimate.total
    check_device_memory(_config(tmp_path, device_memory_gb=total * 1.001 / GB), read_model_config(config), 64)
    with pytest.raises(ConfigError, match=r"^train\.device_memory_gb: this run needs about"):
        check_device_memory(_config(tmp_path, device_memory_gb=total * 0.999 / GB), read_model_config(config), 64)


def test_sharding_is_offered_first_once_the_config_has_the_key(tmp_path, monkeypatch):
    monkeypatch.setattr(device_memory, "can_shard", lambda: True)
    config = _config(tmp_path, device_memory_gb=1e-6, reduction="fast")
    with pytest.raises(ConfigError, match=r'try, in order: train\.sharding = "fsdp"; \[model\.lora\]'):
        check_device_memory(config, read_model_config(config), 64)


def test_validate_returns_the_report_and_the_cli_prints_the_table(tmp_path, capsys):
    checked = validate_inputs(_config(tmp_path, device_memory_gb=80))
    assert checked.memory is not None and checked.memory.limit_bytes == 80 * GB
    print_memory(checked.memory)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("memory per rank (sharding=none, W=")
    assert err[-2].split()[0] == "total" and err[-1] == "  (fits the 80.00 GB of train.device_memory_gb=80)"
