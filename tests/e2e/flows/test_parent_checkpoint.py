"""`model.path` naming a committed checkpoint: `RUN@latest`, `RUN@step-N` or its URL; verified, fetched, recorded.

One short run commits a checkpoint; each test starts a next run from it. References: the committed
`model.safetensors` bytes (the next run's initial weights must be exactly them), the ledger, and the store's
own bytes changed under an intact manifest.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flows.cli import main
from flows.pipeline import train_flow
from infra.launch.failures import FailureClass, classify_exception
from infra.publication.parent import CheckpointNotVerified, resolve_parent
from infra.runs import ledger
from tests.cli.watched_run import toml_text as _toml
from tests.conftest import EXAMPLES, tiny_tree
from trainer_core.config import ConfigError, RunConfig, config_from_dict
from trainer_core.errors import BadInputError
from trainer_core.model import build_trainer
from trainer_core.run.parent_record import PARENT_FILE
from trainer_core.run.plan import build_plan

pytestmark = [pytest.mark.flow, pytest.mark.distributed]

SHORT = {"steps": 2, "steps_per_segment": 2, "nproc_per_node": 1, "logical_dp": 1}


@pytest.fixture(scope="module")
def parent(prefect_harness, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parent")
    config = config_from_dict(tiny_tree(tmp, train=SHORT), config_dir=tmp)
    result = train_flow(config)
    assert isinstance(result, dict) and result["status"] == "completed", result
    return config, result


def child(tmp_path: Path, parent_config: RunConfig, model_path: str, store_url: str | None = None) -> RunConfig:
    tree = tiny_tree(tmp_path, train=SHORT)
    tree["model"] = {"path": model_path}
    tree["storage"] = {"url": store_url or parent_config.storage.url}
    return config_from_dict(tree, config_dir=tmp_path)


def committed_weights(result: dict) -> dict[str, torch.Tensor]:
    return load_file(str(Path(result["checkpoint_url"]) / "model.safetensors"))


def test_a_run_starts_from_the_committed_weights_however_they_are_named(parent, tmp_path):
    parent_config, result = parent
    run_id, url = result["run_id"], result["checkpoint_url"]
    run_ids = set()
    references = [f"{run_id}@latest", f"{run_id}@step-00000002", f"{run_id}@step-2", url, f"file://{url}"]
    for index, reference in enumerate(references):
        config = child(tmp_path / str(index), parent_config, reference)
        found = resolve_parent(config)
        assert found is not None and found.url == url and found.run_id == run_id, reference
        assert config.model.path is not None and Path(config.model.path).is_relative_to(config.run.work_dir)
        model = build_trainer(config).model
        weights = committed_weights(result)
        state = model.state_dict()
        for name, tensor in weights.items():
            assert torch.equal(state[name], tensor), (reference, name)
        run_ids.add(build_plan(config)[0].run_id)
    assert len(run_ids) == 1  # the same weights, however named: the same run
    plain = config_from_dict(tiny_tree(tmp_path / "plain", train=SHORT), config_dir=tmp_path)
    assert build_plan(plain)[0].run_id not in run_ids


def test_the_next_run_trains_and_its_ledger_names_the_parent(parent, tmp_path, capsys):
    """`rankflow run` with `model.path = "RUN@latest"`: fetched before planning, trained, the parent in the ledger."""
    parent_config, result = parent
    config_file = tmp_path / "next.toml"
    config_file.write_text(
        "\n".join(
            [
                '[run]\nname = "next"',
                f'[model]\npath = "{result["run_id"]}@latest"',
                f'[tokenizer]\npath = "{EXAMPLES / "tiny" / "tokenizer.json"}"',
                f'[data]\npath = "{EXAMPLES / "tiny" / "sft.jsonl"}"\nmax_seq_len = 128',
                "[train]\nsteps = 2\nsteps_per_segment = 2\nglobal_batch_size = 8",
                f'[storage]\nurl = "{parent_config.storage.url}"',
            ]
        )
    )
    assert main(["run", str(config_file), "--set", f"run.work_dir={tmp_path / 'work'}"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["status"] == "completed" and summary["run_id"].startswith("next-")
    (plan_line,) = [e for e in ledger.read(tmp_path / "work" / summary["run_id"]) if e["stage"] == "plan"]
    assert plan_line["parent"]["url"] == result["checkpoint_url"]
    assert plan_line["parent"]["checkpoint"] == "step-00000002"


def test_bytes_changed_in_the_store_are_refused_and_a_changed_cache_is_fetched_again(parent, tmp_path):
    parent_config, result = parent
    store = tmp_path / "store-copy"
    shutil.copytree(parent_config.storage.url, store)
    url = str(store / result["run_id"] / "checkpoints" / "step-00000002")
    config = child(tmp_path / "ok", parent_config, url, store_url=str(store))
    resolve_parent(config)
    cached = Path(config.model.path or "") / "model.safetensors"
    good = cached.read_bytes()
    data = bytearray(good)
    data[-1] ^= 0xFF  # the same size: only the hash can tell
    cached.write_bytes(bytes(data))
    again = child(tmp_path / "ok", parent_config, url, store_url=str(store))
    resolve_parent(again)
    assert cached.read_bytes() == good and (cached.parent / PARENT_FILE).is_file()

    (Path(url) / "model.safetensors").write_bytes(bytes(data))  # under an intact manifest
    damaged = child(tmp_path / "damaged", parent_config, url, store_url=str(store))
    with pytest.raises(CheckpointNotVerified, match=r"does not verify: .*model\.safetensors") as caught:
        resolve_parent(damaged)
    # The store's fault, not the input's: never bad input (exit 2, not retried), as for `rankflow eval` and `pull`
    assert not isinstance(caught.value, BadInputError)
    assert classify_exception(caught.value) is FailureClass.STORAGE_OUTAGE
    assert not (Path(damaged.run.work_dir) / "cache" / "parents" / result["run_id"] / "step-00000002").exists()


@pytest.mark.parametrize("reference", ["no-such-run-0123456789ab@latest", "{run}@step-00000099"])
def test_a_reference_that_names_no_committed_checkpoint_exits_2_and_writes_nothing(parent, tmp_path, capsys, reference):
    parent_config, result = parent
    config = child(tmp_path, parent_config, reference.format(run=result["run_id"]))
    with pytest.raises(ConfigError, match="model.path="):
        resolve_parent(config)
    assert not Path(config.run.work_dir).exists()


def _spoil(case: str, tree: dict, store: Path, result: dict) -> None:
    if case == "an empty data file":  # found by the input checks, after the parent was fetched
        empty = store.parent / "empty.jsonl"
        empty.write_text("")
        tree["data"]["path"] = str(empty)
    elif case == "a LoRA rank other than the adapter's":  # a full checkpoint has no adapter: the rank is checked
        tree["model"]["lora"] = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj"], "init_from": "/nonexistent"}
    else:  # a flipped byte under an intact manifest: the verified fetch (or LATEST's resolution) refuses it
        weights = store / result["run_id"] / "checkpoints" / "step-00000002" / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("case", "work_dir"),
    [
        ("an empty data file", "new"),
        ("an empty data file", "holding this parent"),  # cached by an earlier run: it stays
        ("an empty data file", "filled by another run meanwhile"),  # made by this run, then another's too
        ("a LoRA rank other than the adapter's", "new"),
        ("a flipped byte", "new"),
        ("a flipped byte", "holding another parent"),  # cache/parents exists: no empty run folder is left
        ("a flipped byte, by RUN@latest", "new"),  # its only checkpoint does not verify: refused before a download
    ],
)
def test_a_refused_run_leaves_no_copy_of_its_parent(parent, tmp_path, capsys, monkeypatch, case, work_dir):
    """Bad input exits 2, a parent that does not verify in the store 1 (the store's fault: one class with `rankflow
    eval` and `checkpoints pull`), each with one line and no cache entry: nothing written, and nothing else removed.
    """
    parent_config, result = parent
    store = tmp_path / "store"
    shutil.copytree(parent_config.storage.url, store)
    work = tmp_path / "work"
    tree = tiny_tree(tmp_path, train=SHORT)
    tree["model"] = {"path": f"{result['run_id']}@latest"}
    if case == "a flipped byte":  # by URL: RUN@latest skips a LATEST that does not verify before any download
        tree["model"]["path"] = str(store / result["run_id"] / "checkpoints" / "step-00000002")
    tree["storage"] = {"url": str(store)}
    entry = work / "cache" / "parents" / result["run_id"] / "step-00000002"
    if work_dir == "holding this parent":
        resolve_parent(config_from_dict(tree, config_dir=tmp_path))
        assert entry.is_dir()
    elif work_dir == "holding another parent":
        (work / "cache" / "parents" / "other-0123456789ab" / "step-00000001").mkdir(parents=True)
    elif work_dir == "filled by another run meanwhile":
        import trainer_core.run.validate as validate

        checks = validate.validate_inputs

        def another_run_writes_first(config):  # the refused run's checks are slow; another run starts meanwhile
            (work / "other-run-0123456789ab").mkdir()
            (work / "other-run-0123456789ab" / "ledger.jsonl").write_text("{}\n")
            return checks(config)

        monkeypatch.setattr(validate, "validate_inputs", another_run_writes_first)
    before = sorted(work.rglob("*")) if work.exists() else None
    _spoil(case, tree, store, result)
    config_file = tmp_path / "child.toml"
    config_file.write_text(_toml(tree))
    capsys.readouterr()
    code = main(["run", str(config_file)])
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    if case.startswith("a flipped byte"):  # before: exit 2, "bad input", a failure class never retried
        assert code == 1 and captured.err.startswith("rankflow: run failed: model.path="), captured.err
        assert "does not verify" in captured.err or "verifies in" in captured.err, captured.err
        summary = json.loads(captured.out.strip().splitlines()[-1])
        assert (summary["status"], summary["failed_stage"], summary["failure_cause"]) == (
            "failed",
            "model-fetch",
            "storage_outage",
        )
        assert summary["error"].startswith("CheckpointNotVerified: ")
    else:
        assert code == 2 and captured.out == "", captured.out
        assert captured.err.startswith("rankflow: bad input: "), captured.err
    after = sorted(work.rglob("*")) if work.exists() else None
    if work_dir == "filled by another run meanwhile":  # the other run's files stay; nothing of this one's
        assert after == [work / "other-run-0123456789ab", work / "other-run-0123456789ab" / "ledger.jsonl"], after
    else:
        assert after == before, (before, after)


def test_a_new_adapter_over_a_committed_full_checkpoint_ships_that_base(parent, tmp_path):
    """The base lies in this run's cache: the checkpoint must carry it (`base/`), not name the cache's path."""
    parent_config, result = parent
    tree = tiny_tree(tmp_path, train=SHORT)
    tree["model"] = {
        "path": f"{result['run_id']}@latest",
        "lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj"]},
    }
    tree["storage"] = {"url": parent_config.storage.url}
    adapter_run = train_flow(config_from_dict(tree, config_dir=tmp_path))
    assert isinstance(adapter_run, dict) and adapter_run["status"] == "completed", adapter_run
    checkpoint = Path(adapter_run["checkpoint_url"])
    adapter_config = json.loads((checkpoint / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "base"
    base_weights = load_file(str(checkpoint / "base" / "model.safetensors"))
    parent_weights = committed_weights(result)
    assert base_weights.keys() == parent_weights.keys()
    assert all(torch.equal(base_weights[name], tensor) for name, tensor in parent_weights.items())
    shutil.rmtree(Path(tree["run"]["work_dir"]) / "cache")  # the checkpoint stands without the run's cache
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(checkpoint / "base"), local_files_only=True)
    assert isinstance(PeftModel.from_pretrained(base, str(checkpoint)), PeftModel)


@pytest.mark.parametrize("scheme", ["", "file://"])
def test_a_checkpoint_url_through_a_symlink_loop_is_bad_input(parent, tmp_path, scheme):
    """Not an outage (reading through the loop fails with ELOOP, an OSError): exit 2 naming model.path."""
    parent_config, result = parent
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    reference = f"{scheme}{loop}/{result['run_id']}/checkpoints/step-00000002"
    with pytest.raises(ConfigError, match=r"model\.path='.*loop/.*' is a symbolic link that loops"):
        resolve_parent(child(tmp_path, parent_config, reference))  # the plain path: refused by the config already
    assert not (tmp_path / "work").exists()
