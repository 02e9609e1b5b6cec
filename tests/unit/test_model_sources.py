"""Where a run's model comes from: a hub model id through the Hugging Face cache, and the attention kernel.

The hub tests never reach the network: `HF_HUB_OFFLINE` is on, and the cache is one the test writes in
huggingface_hub's own layout (`models--ORG--NAME/refs/main`, `snapshots/COMMIT/…`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from flows.cli import main
from tests.bad_input.harness import Assets, to_toml
from tests.conftest import tiny_tree
from trainer_core.config import ConfigError, config_from_dict
from trainer_core.memory_shape import activation_fit
from trainer_core.model import build_model
from trainer_core.model_config import read_model_config
from trainer_core.model_source import resolve_hub_model
from trainer_core.run.plan import digest_view

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache, offline (huggingface_hub reads both settings at import: patched there too)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def cache_model(cache: Path, repo_id: str, source: Path, commit: str, ref: str | None = "main") -> Path:
    """`source`'s files as the snapshot `commit` of `repo_id` (blobs linked from the snapshot, as the hub writes)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in source.iterdir():
        blob = repo / "blobs" / f"{commit[:8]}-{file.name}"
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def hub_config(tmp_path: Path, path: str, **model):
    return config_from_dict(tiny_tree(tmp_path, model={"config": None, "path": path, **model}), config_dir=tmp_path)


def test_a_hub_id_is_read_from_the_cache_at_its_commit_and_the_run_id_names_the_commit(tmp_path, hub_cache):
    model_dir = Assets(tmp_path).model_dir()
    snapshot = cache_model(hub_cache, "acme/tiny-lm", model_dir, COMMIT_A)
    config = hub_config(tmp_path, "acme/tiny-lm")
    assert config.model.path == "acme/tiny-lm"  # not a directory beside the config: left for the resolution
    resolve_hub_model(config)
    assert (config.model.path, config.model.revision) == (str(snapshot), COMMIT_A)
    resolve_hub_model(config)  # resolved already: nothing changes
    assert config.model.path == str(snapshot)
    # The weights are the cached files' (the reference: the directory the snapshot was made from).
    model, _ = build_model(config)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    for (name, got), (_, want) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(got, want), name
    # The run id names the commit: the same files at another commit are another run; a local directory has none.
    cache_model(hub_cache, "acme/tiny-lm", model_dir, COMMIT_B, ref="v2")
    moved = hub_config(tmp_path, "acme/tiny-lm", revision="v2")
    resolve_hub_model(moved)
    assert moved.model.revision == COMMIT_B
    assert digest_view(config)["model"]["revision"] == COMMIT_A
    assert digest_view(moved)["model"]["revision"] == COMMIT_B
    local = hub_config(tmp_path, str(model_dir))
    assert "revision" not in digest_view(local)["model"]


def test_a_directory_beside_the_config_named_like_a_hub_id_stays_a_local_directory(tmp_path, hub_cache):
    model_dir = Assets(tmp_path).model_dir()
    shutil.copytree(model_dir, tmp_path / "acme" / "tiny-lm")
    config = hub_config(tmp_path, "acme/tiny-lm")
    assert config.model.path == str(tmp_path / "acme" / "tiny-lm")
    resolve_hub_model(config)
    assert (config.model.path, config.model.revision) == (str(tmp_path / "acme" / "tiny-lm"), None)


@pytest.mark.parametrize(
    ("path", "model", "expected"),
    [
        ("acme/missing", {}, r"model\.path='acme/missing' is not in the Hugging Face cache .* HF_HUB_OFFLINE is set"),
        ("acme/tiny-lm", {"revision": "v9"}, r"model\.path='acme/tiny-lm' at revision 'v9' is not in the Hugging Face"),
        ("acme/bad--name", {}, r"model\.path='acme/bad--name' is no local directory and no valid hub model id"),
    ],
)
def test_a_bad_hub_id_is_bad_input_naming_the_key(tmp_path, hub_cache, path, model, expected):
    cache_model(hub_cache, "acme/tiny-lm", Assets(tmp_path).model_dir(), COMMIT_A)
    with pytest.raises(ConfigError, match=expected):
        resolve_hub_model(hub_config(tmp_path, path, **model))


def test_rankflow_run_on_an_uncached_hub_id_exits_2_in_one_line(tmp_path, hub_cache, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "run.toml"
    tree = tiny_tree(tmp_path, model={"path": "acme/missing"})
    del tree["model"]["config"]
    config.write_text(to_toml(tree))
    assert main(["run", str(config)]) == 2
    err = capsys.readouterr().err
    assert "model.path='acme/missing' is not in the Hugging Face cache" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "work").exists()


def test_deploy_checks_a_hub_model_from_the_cache_and_deploys_its_id_at_that_commit(
    tmp_path, hub_cache, capsys, monkeypatch
):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    import flows.deploy

    cache_model(hub_cache, "acme/tiny-lm", Assets(tmp_path).model_dir(), COMMIT_A)
    deployed = []

    def register(config, **_):
        deployed.append(config)
        raise ConnectionError("no server in this test")

    monkeypatch.setattr(flows.deploy, "deploy_training", register)
    tree = tiny_tree(tmp_path, model={"path": "acme/tiny-lm"})
    del tree["model"]["config"]
    (tmp_path / "run.toml").write_text(to_toml(tree))
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        assert main(["deploy", str(tmp_path / "run.toml"), "--pool", "ok"]) == 1  # checked, then not registered
    assert "could not register the deployment" in capsys.readouterr().err
    assert (deployed[0].model.path, deployed[0].model.revision) == ("acme/tiny-lm", COMMIT_A)


def test_a_revision_without_a_hub_id_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.revision='main' applies to a hub model id"):
        hub_config(tmp_path, str(Assets(tmp_path).model_dir()), revision="main")


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_attn_implementation_is_the_kernel_transformers_builds_and_in_the_run_id_only_when_set(tmp_path, kernel):
    config = config_from_dict(tiny_tree(tmp_path, model={"attn_implementation": kernel}), config_dir=tmp_path)
    model, _ = build_model(config)
    assert model.config._attn_implementation == kernel
    assert digest_view(config)["model"]["attn_implementation"] == kernel
    unset = config_from_dict(tiny_tree(tmp_path), config_dir=tmp_path)
    assert "attn_implementation" not in digest_view(unset)["model"]  # the examples' run ids stay (test_run_ids.py)
    # The memory prediction counts what the kernel keeps: eager's T x T probabilities, nothing quadratic for sdpa.
    quadratic = activation_fit(read_model_config(config), "float32").layer_quadratic
    assert quadratic > 0 if kernel == "eager" else quadratic == 0


def test_flash_attention_without_its_package_is_refused_naming_the_key(tmp_path):
    import importlib.util

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    tree = tiny_tree(tmp_path, model={"attn_implementation": "flash_attention_2"})
    with pytest.raises(ConfigError, match=r"model\.attn_implementation.*needs the flash-attn package"):
        config_from_dict(tree, config_dir=tmp_path)
