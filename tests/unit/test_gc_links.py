"""`rankflow checkpoints gc` on a local store never follows a symbolic link out of the store.

The reference is the bytes outside the store: every file a link points at
is still there, byte for byte, after gc, while the store's own orphans are
still removed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flows.cli import main
from infra.publication.commit import commit_checkpoint
from infra.store import open_store
from infra.store.durable import TEMP_MARKER
from infra.store.objects import remove_files
from tests.publication_helpers import RUN, random_files, stage


def _outside(tmp_path: Path) -> dict[Path, bytes]:
    """Files outside the store that links will point at (or into): path -> bytes."""
    files = {
        tmp_path / "outside" / "precious.bin": b"precious " * 50,
        tmp_path / "outside" / "dir" / "model.safetensors": b"dir " * 60,
        tmp_path / "outside" / "ckpt" / "model.safetensors": b"ckpt " * 70,
        tmp_path / "outside" / "tmpdir" / f".model{TEMP_MARKER}123-abcd": b"temporary " * 80,
        tmp_path / "outside" / "victim" / "checkpoints" / "step-00000030" / "model.safetensors": b"victim " * 90,
        tmp_path / "outside" / "victim" / f".x{TEMP_MARKER}9-ffff": b"victim tmp " * 10,
    }
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return files


def _unchanged(files: dict[Path, bytes]) -> list[str]:
    return [str(path) for path, data in files.items() if not path.is_file() or path.read_bytes() != data]


@pytest.fixture
def store_dir(tmp_path) -> Path:
    commit_checkpoint(stage(tmp_path, 10, random_files(1, 1000)), open_store(str(tmp_path / "store")), RUN)
    return tmp_path / "store"


def test_gc_never_follows_a_link_inside_a_run_out_of_the_store(store_dir, tmp_path, capsys):
    outside = _outside(tmp_path)
    checkpoints = store_dir / RUN / "checkpoints"
    orphan = checkpoints / "step-00000030"  # a commit that died: no manifest
    orphan.mkdir()
    (orphan / "model-00000-of-00002.safetensors").write_bytes(b"real orphan")
    (orphan / "model-00001-of-00002.safetensors").symlink_to(tmp_path / "outside" / "precious.bin")
    (orphan / "shards").symlink_to(tmp_path / "outside" / "dir", target_is_directory=True)
    (checkpoints / "step-00000040").symlink_to(tmp_path / "outside" / "ckpt", target_is_directory=True)
    (store_dir / RUN / "scratch").symlink_to(tmp_path / "outside" / "tmpdir", target_is_directory=True)

    assert main(["checkpoints", "gc", RUN, "--store", str(store_dir)]) == 0
    captured = capsys.readouterr()
    assert _unchanged(outside) == [], f"gc changed files outside the store: {_unchanged(outside)}"
    assert not (orphan / "model-00000-of-00002.safetensors").exists(), "the store's own orphan was not removed"
    assert "symbolic link" in captured.err  # the links it left alone are named


def test_gc_of_a_run_prefix_that_links_out_of_the_store_refuses_and_touches_nothing(store_dir, tmp_path, capsys):
    outside = _outside(tmp_path)
    linked_run = "linked-0123456789ab"
    (store_dir / linked_run).symlink_to(tmp_path / "outside" / "victim", target_is_directory=True)
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "outside").rglob("*"))

    assert main(["checkpoints", "gc", linked_run, "--store", str(store_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "symbolic link" in err[0] and str(tmp_path / "outside" / "victim") in err[0]
    assert _unchanged(outside) == []
    # Not even a lease was written through the link.
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "outside").rglob("*")) == before


def test_removal_refuses_a_path_whose_directory_leads_out_of_the_store(store_dir, tmp_path):
    outside = _outside(tmp_path)
    (store_dir / RUN / "elsewhere").symlink_to(tmp_path / "outside" / "dir", target_is_directory=True)
    store = open_store(str(store_dir))
    with pytest.raises(OSError, match="outside the store"):
        remove_files(store, store.path(RUN, "elsewhere"), ["model.safetensors"])
    assert _unchanged(outside) == []
    # A link itself, inside the store, may go: its target stays.
    os.symlink(tmp_path / "outside" / "precious.bin", store_dir / RUN / "a-link")
    remove_files(store, store.path(RUN), ["a-link"])
    assert not (store_dir / RUN / "a-link").is_symlink() and _unchanged(outside) == []
