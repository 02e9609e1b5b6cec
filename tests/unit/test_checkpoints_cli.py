"""`rankflow checkpoints list | verify | pull | gc` on a local store, including hostile contents."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flows.cli import main
from infra.publication.commit import commit_checkpoint
from infra.store import open_store
from tests.conftest import EXAMPLES
from tests.publication_helpers import RUN, random_files, same_size_other_bytes, stage


@pytest.fixture
def store_dir(tmp_path) -> Path:
    store = open_store(str(tmp_path / "store"))
    for step in (10, 20):
        commit_checkpoint(stage(tmp_path, step, random_files(2, 3000)), store, RUN)
    return tmp_path / "store"


def test_list_marks_latest_and_prints_json(store_dir, capsys):
    assert main(["checkpoints", "list", RUN, "--store", str(store_dir)]) == 0
    out = capsys.readouterr().out
    assert "step-00000010  verified" in out and "step-00000020  verified" in out and "<- latest" in out
    assert main(["checkpoints", "list", RUN, "--store", str(store_dir), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert listed["latest"] == "step-00000020" and [c["verified"] for c in listed["checkpoints"]] == [True, True]
    assert listed["checkpoints"][0]["provenance"]["run_id"] == RUN


def test_verify_hashes_every_byte_and_fails_on_corruption(store_dir, capsys):
    assert main(["checkpoints", "verify", RUN, "--store", str(store_dir)]) == 0
    victim = next((store_dir / RUN / "checkpoints" / "step-00000020").glob("*.safetensors"))
    same_size_other_bytes(victim)  # same size: only hashing notices
    assert main(["checkpoints", "verify", RUN, "20", "--store", str(store_dir)]) == 1
    assert "does not match the manifest" in capsys.readouterr().out


def test_pull_falls_back_from_a_corrupt_latest_and_says_so(store_dir, tmp_path, capsys):
    (store_dir / RUN / "LATEST").write_text('{"step": "twenty"}')
    dest = tmp_path / "pulled"
    assert main(["checkpoints", "pull", RUN, "--store", str(store_dir), "--dest", str(dest)]) == 0
    captured = capsys.readouterr()
    assert "falling back to the newest verified checkpoint step-00000020" in captured.err
    assert (dest / "MANIFEST.json").is_file() and len(list(dest.glob("*.safetensors"))) == 2
    assert main(["checkpoints", "pull", RUN, "--store", str(store_dir), "--dest", str(dest)]) == 1  # not empty
    assert "not an empty directory" in capsys.readouterr().err


def test_gc_reports_and_removes_orphans(store_dir, capsys):
    orphan = store_dir / RUN / "checkpoints" / "step-00000030"
    orphan.mkdir()
    (orphan / "model.safetensors").write_bytes(b"x" * 100)
    assert main(["checkpoints", "gc", RUN, "--store", str(store_dir), "--dry-run"]) == 0
    assert "would remove 1 objects" in capsys.readouterr().out and orphan.joinpath("model.safetensors").exists()
    assert main(["checkpoints", "gc", RUN, "--store", str(store_dir)]) == 0
    assert "removed 1 objects" in capsys.readouterr().out and not orphan.joinpath("model.safetensors").exists()


def test_the_store_comes_from_exactly_one_of_store_or_config(store_dir, tmp_path, capsys):
    assert main(["checkpoints", "list", RUN]) == 2
    assert "exactly one of --store URL" in capsys.readouterr().err
    config = tmp_path / "run.toml"
    config.write_text(
        (EXAMPLES / "tiny_sft.toml")
        .read_text()
        .replace('"tiny/', f'"{EXAMPLES}/tiny/')
        .replace('url = ".rankflow/store"', f'url = "{store_dir}"')
        .replace('work_dir = ".rankflow/work"', f'work_dir = "{tmp_path / "work"}"')
    )
    assert main(["checkpoints", "list", RUN, "--config", str(config), "--store", str(store_dir)]) == 2
    capsys.readouterr()
    assert main(["checkpoints", "list", RUN, "--config", str(config)]) == 0
    assert "step-00000020" in capsys.readouterr().out


def test_gc_with_a_config_applies_its_retention(store_dir, tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(
        (EXAMPLES / "tiny_sft.toml")
        .read_text()
        .replace('"tiny/', f'"{EXAMPLES}/tiny/')
        .replace('url = ".rankflow/store"', f'url = "{store_dir}"\nkeep_last = 1')
        .replace('work_dir = ".rankflow/work"', f'work_dir = "{tmp_path / "work"}"')
    )
    assert main(["checkpoints", "gc", RUN, "--store", str(store_dir)]) == 0  # --store alone: no retention
    assert main(["checkpoints", "gc", RUN, "--config", str(config)]) == 0
    assert "retention (storage.keep_last = 1, keep_every = None) removed 1 checkpoints\n    step-00000010" in (
        capsys.readouterr().out
    )
    assert main(["checkpoints", "list", RUN, "--store", str(store_dir), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [c["checkpoint"] for c in listed["checkpoints"]] == ["step-00000020"]
    assert not (store_dir / RUN / "checkpoints" / "step-00000010").exists()


def test_verify_says_retired_for_a_checkpoint_an_interrupted_gc_hid_and_exits_0(store_dir, capsys, monkeypatch):
    from infra.publication import retention
    from infra.publication.finalizer import FinalizerSettings

    def killed(*args, **kwargs):
        raise RuntimeError("gc killed before it removed the data")

    monkeypatch.setattr(retention, "remove_files", killed)  # after the retired record and the manifest's removal
    store = open_store(str(store_dir))
    with pytest.raises(RuntimeError, match="gc killed"):
        retention.apply_retention(store, RUN, retention.RetentionPolicy(keep_last=1), FinalizerSettings(wait_s=5.0))
    left = store_dir / RUN / "checkpoints" / "step-00000010"
    assert not (left / "MANIFEST.json").exists() and any(left.glob("*.safetensors"))  # hidden, its data left
    for args in ([], ["10"]):
        assert main(["checkpoints", "verify", RUN, *args, "--store", str(store_dir)]) == 0
        out = capsys.readouterr().out
        assert "step-00000010  retired (storage.keep_last = 1, storage.keep_every = None)" in out, out
        assert "FAILED" not in out
    # A checkpoint with a manifest is never called retired, whatever a record says: damaged, it fails.
    (store_dir / RUN / "retired" / "step-00000020.json").write_bytes(
        (store_dir / RUN / "retired" / "step-00000010.json").read_bytes()
    )
    same_size_other_bytes(next((store_dir / RUN / "checkpoints" / "step-00000020").glob("*.safetensors")))
    assert main(["checkpoints", "verify", RUN, "20", "--store", str(store_dir)]) == 1
    assert "step-00000020  FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["runs", "list", "verify"])
def test_a_store_that_is_a_symlink_loop_is_bad_input(tmp_path, capsys, command):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    args = [] if command == "runs" else [RUN]
    assert main(["checkpoints", command, *args, "--store", f"file://{loop}"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert re.match(r"rankflow: bad input: --store='.*loop' is a symbolic link that loops", line), line
