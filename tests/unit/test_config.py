"""Config validation: unknown keys, wrong types, impossible combinations, overrides."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flows.cli import main
from tests.conftest import EXAMPLES, tiny_tree
from trainer_core.config import ConfigError, config_from_dict, load_config


def write_toml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_example_config_loads_with_absolute_paths():
    config = load_config(EXAMPLES / "tiny_sft.toml")
    assert Path(config.data.path).is_absolute() and Path(config.data.path).is_file()
    assert config.train.num_segments == 3
    assert config.export_after_segment(2) and not config.export_after_segment(0)


def test_set_overrides_parse_toml_values():
    config = load_config(EXAMPLES / "tiny_sft.toml", ["train.steps=9", "train.learning_rate=1e-3", "run.name=other"])
    assert config.train.steps == 9 and config.train.learning_rate == 1e-3 and config.run.name == "other"


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"train": {"stepz": 3}}, "train.stepz: unknown key"),
        ({"train": {"steps": "ten"}}, "train.steps: must be a whole number (got 'ten'); write a whole number"),
        # pydantic reads true as 1: `--set train.steps=true` must not train one step
        (
            {"train": {"steps": True}},
            "train.steps: must be a whole number (got True); write a whole number, not true or false",
        ),
        ({"train": {"eval_every": True}}, "train.eval_every: must be a whole number (got True)"),
        ({"train": {"learning_rate": False}}, "train.learning_rate: must be a number (got False)"),
        ({"train": {"betas": [False, 0.9]}}, "train.betas: must be a list of numbers (got "),
        (
            {"train": {"logical_dp": 3, "nproc_per_node": 2}},
            "train.logical_dp=3 is not a multiple of train.nproc_per_node=2",
        ),
        ({"train": {"global_batch_size": 5}}, "train.global_batch_size=5 is not a multiple of train.logical_dp=2"),
        ({"data": {"kind": "dpo"}}, "data.kind"),
        ({"train": {"reduction": "exact"}}, "train.reduction"),
        ({"train": {"threads_per_process": 0}}, "train.threads_per_process"),
        ({"model": {"path": "/somewhere"}}, "set exactly one of model.path"),
    ],
)
def test_bad_config_names_the_key(tmp_path, sections, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        config_from_dict(tiny_tree(tmp_path, **sections), config_dir=tmp_path)


def test_booleans_stay_where_a_boolean_is_meant(tmp_path):
    config = config_from_dict(
        tiny_tree(tmp_path, storage={"keep_states": True}, data={"pack": True}), config_dir=tmp_path
    )
    assert config.storage.keep_states is True and config.data.pack is True


@pytest.mark.parametrize(
    ("key", "section"),
    [
        ("model.path", "model"),
        ("tokenizer.path", "tokenizer"),
        ("run.work_dir", "run"),
        ("storage.url", "storage"),
        ("data.path", "data"),
        ("tracking.uri", "tracking"),
    ],
)
def test_a_path_that_is_a_symlink_loop_is_bad_input_naming_its_key(tmp_path, key, section):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    values = {"path": str(loop), "config": None} if key == "model.path" else {key.split(".")[1]: str(loop)}
    if key == "tracking.uri":  # as MLflow's file: URI too
        values = {"backend": "mlflow", "uri": f"file://{loop}"}
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}='.*loop' is a symbolic link that loops"):
        config_from_dict(tiny_tree(tmp_path, **{section: values}), config_dir=tmp_path)


def test_missing_data_file_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.path=.*does not exist"):
        config_from_dict(tiny_tree(tmp_path, data={"path": str(tmp_path / "nope.jsonl")}), config_dir=tmp_path)


def test_cli_bad_config_exits_2_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = write_toml(tmp_path / "bad.toml", (EXAMPLES / "tiny_sft.toml").read_text())
    code = main(
        [
            "run",
            str(config),
            "--set",
            f"model.config={EXAMPLES}/tiny/model_config.json",
            "--set",
            f"tokenizer.path={EXAMPLES}/tiny/tokenizer.json",
            "--set",
            f"data.path={EXAMPLES}/tiny/sft.jsonl",
            "--set",
            "train.logical_dp=3",
        ]
    )
    assert code == 2
    assert "train.logical_dp=3 is not a multiple" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [config]


def test_cli_unknown_key_exits_2(tmp_path, capsys):
    config = write_toml(tmp_path / "bad.toml", "[train]\nsteps = 3\nlearning_rat = 0.1\n")
    assert main(["run", str(config)]) == 2
    err = capsys.readouterr().err
    assert "train.learning_rat: unknown key" in err and "model: required section is missing; add a [model] table" in err


def test_cli_not_toml_exits_2(tmp_path, capsys):
    config = write_toml(tmp_path / "bad.toml", "[train\n")
    assert main(["run", str(config)]) == 2
    assert "not valid TOML" in capsys.readouterr().err


def test_unset_then_set_switches_model_config_to_model_path_without_a_new_file(tmp_path, monkeypatch):
    from flows.cli.parser import build_parser
    from flows.cli.run import _load

    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    monkeypatch.chdir(tmp_path)
    argv = ["run", str(EXAMPLES / "tiny_sft.toml"), "--unset", "model.config", "--set", f"model.path={model_dir}"]
    config = _load(build_parser().parse_args(argv))
    assert (config.model.path, config.model.config) == (str(model_dir), None)
    # without --unset the file's model.config stays beside the new path: refused, as before
    with pytest.raises(ConfigError, match=r"set exactly one of model\.path"):
        load_config(EXAMPLES / "tiny_sft.toml", [f"model.path={model_dir}"])


def test_unset_removes_keys_and_whole_sections():
    given = load_config(EXAMPLES / "tiny_sft.toml")
    assert given.data.eval_path is not None and given.train.eval_every and given.tracking.backend == "mlflow"
    config = load_config(EXAMPLES / "tiny_sft.toml", unset=["data.eval_path", "train.eval_every", "tracking"])
    assert config.data.eval_path is None and not config.train.eval_every and config.tracking.backend == "none"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--unset", "model.confg"],
            r"--unset model\.confg: .* does not set model\.confg \(under model it sets config\)",
        ),
        (["--unset", "nope.key"], r"--unset nope\.key: .* does not set nope\.key \(under the top level it sets data, "),
        (["--unset", "train.steps", "--set", "train.steps=3"], r"--unset train\.steps and --set train\.steps=…"),
    ],
)
def test_cli_bad_unset_exits_2_naming_the_key(tmp_path, capsys, monkeypatch, argv, expected):
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(EXAMPLES / "tiny_sft.toml"), *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(expected, err) and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []
