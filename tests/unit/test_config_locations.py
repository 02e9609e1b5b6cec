"""Overlapping work directory and local store are refused when the config is validated.

Before this check, a store inside the staging (a run directory) passed, and
cleanup then deleted the committed checkpoint while the run exited 0; a
store equal to the work directory failed only after a good commit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.cli import main
from tests.conftest import tiny_tree
from trainer_core.config import ConfigError, config_from_dict


@pytest.mark.parametrize(
    ("store", "expected"),
    [
        ("work", "are the same directory"),
        ("work/test-0123456789ab/export", "lies inside .*test-0123456789ab, which rankflow rewrites and deletes"),
        ("work/cache/store", "lies inside .*cache"),
        (".", "the work directory lies inside the store"),
    ],
)
def test_overlapping_locations_are_refused(tmp_path, store, expected):
    tree = tiny_tree(tmp_path, storage={"url": str(tmp_path / store)})
    with pytest.raises(ConfigError, match=expected):
        config_from_dict(tree, config_dir=tmp_path)
    with pytest.raises(ConfigError, match="same directory"):
        config_from_dict(tiny_tree(tmp_path, storage={"url": f"file://{tmp_path / 'work'}"}), config_dir=tmp_path)


def test_separate_or_remote_locations_are_accepted(tmp_path):
    for url in (str(tmp_path / "store"), str(tmp_path / "work" / "store"), "s3://bucket/prefix"):
        config = config_from_dict(tiny_tree(tmp_path, storage={"url": url}), config_dir=tmp_path)
        assert config.storage.url.endswith(url.rsplit("/", 1)[-1])


def test_the_cli_exits_2_and_writes_nothing(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(f"""
[run]
work_dir = "{tmp_path / "same"}"
[model]
config = "{Path(__file__).resolve().parents[2] / "examples" / "tiny" / "model_config.json"}"
[tokenizer]
path = "{Path(__file__).resolve().parents[2] / "examples" / "tiny" / "tokenizer.json"}"
[data]
path = "{Path(__file__).resolve().parents[2] / "examples" / "tiny" / "sft.jsonl"}"
[storage]
url = "{tmp_path / "same"}"
""")
    assert main(["run", str(config)]) == 2
    assert "storage.url" in capsys.readouterr().err and not (tmp_path / "same").exists()
