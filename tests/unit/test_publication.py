"""Commit protocol on any store (MemoryStore and LocalStore): manifest last, LATEST forward-only, retries skip uploads.

(The storage outage is injected through the commit's observer hook, at the
moment a file has landed, since uploads no longer go through fs.put_file.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.publication.checkpoints import download_checkpoint, latest_checkpoint, list_checkpoints
from infra.publication.cleanup import cleanup_staging
from infra.publication.commit import PublishSettings, commit_checkpoint, read_latest
from tests.publication_helpers import fail_after_uploads
from tests.store_fixtures import memory_or_local_store
from trainer_core.run.manifest import write_manifest

RUN = "run-abc"


def stage(tmp_path: Path, step: int, files: dict[str, bytes]) -> Path:
    staged = tmp_path / "staging" / f"step-{step}"
    staged.mkdir(parents=True)
    for name, data in files.items():
        (staged / name).write_bytes(data)
    write_manifest(staged, {"run_id": RUN, "step": step})
    return staged


def outage_after(num_uploads: int):
    """An observer that cuts the storage off once `num_uploads` files have landed."""
    return fail_after_uploads(num_uploads, ConnectionError("injected storage outage"))


ONE_AT_A_TIME = PublishSettings(concurrency=1)


store = memory_or_local_store  # the fixture, under the name these tests use


FILES = {
    "config.json": b"{}",
    "model-00001-of-00002.safetensors": b"a" * 1000,
    "model-00002-of-00002.safetensors": b"b" * 500,
}


def test_commit_then_read_back(store, tmp_path):
    outcome = commit_checkpoint(stage(tmp_path, 10, FILES), store, RUN)
    assert outcome.num_files_uploaded == 3 and outcome.latest_moved
    assert list_checkpoints(store, RUN) == ["step-00000010"] == [latest_checkpoint(store, RUN)]
    copy = download_checkpoint(store, RUN, "step-00000010", tmp_path / "copy")
    assert {p.name: p.read_bytes() for p in copy.iterdir() if p.name != "MANIFEST.json"} == FILES


def test_reader_never_sees_a_checkpoint_without_its_manifest(store, tmp_path):
    staged = stage(tmp_path, 10, FILES)
    with pytest.raises(ConnectionError):
        commit_checkpoint(staged, store, RUN, settings=ONE_AT_A_TIME, observer=outage_after(2))
    # Data files reached the store (at least the two before the outage), but no manifest: nothing is visible.
    landed = set(store.children(store.key(RUN, "checkpoints", "step-00000010")))
    assert len(landed) >= 2 and "MANIFEST.json" not in landed
    assert (
        list_checkpoints(store, RUN) == [] and latest_checkpoint(store, RUN) is None and read_latest(store, RUN) is None
    )
    retried = commit_checkpoint(staged, store, RUN)
    assert (retried.num_files_skipped, retried.num_files_uploaded) == (len(landed), 3 - len(landed))
    assert set(retried.uploaded).isdisjoint(landed)  # nothing that had landed is uploaded twice
    assert list_checkpoints(store, RUN) == ["step-00000010"]


def test_a_checkpoint_missing_a_file_is_not_listed(store, tmp_path):
    commit_checkpoint(stage(tmp_path, 10, FILES), store, RUN)
    store.remove([store.key(RUN, "checkpoints", "step-00000010", "config.json")])
    assert list_checkpoints(store, RUN) == [] and latest_checkpoint(store, RUN) is None


def test_latest_only_moves_forward(store, tmp_path):
    commit_checkpoint(stage(tmp_path, 20, FILES), store, RUN)
    older = commit_checkpoint(stage(tmp_path, 10, FILES), store, RUN)
    assert not older.latest_moved
    assert json.loads(store.get(store.key(RUN, "LATEST")).data)["step"] == 20
    assert list_checkpoints(store, RUN) == ["step-00000010", "step-00000020"]


def test_cleanup_removes_staging_and_keeps_the_commit(store, tmp_path):
    staged = stage(tmp_path, 10, FILES)
    commit_checkpoint(staged, store, RUN)
    result = cleanup_staging(staged, store, RUN)
    assert not staged.exists() and result["removed_bytes"] > 1500
    assert cleanup_staging(staged, store, RUN)["removed_bytes"] == 0  # a retried cleanup is harmless
    assert list_checkpoints(store, RUN) == ["step-00000010"]


def test_commit_refuses_a_staging_that_no_longer_matches(store, tmp_path):
    staged = stage(tmp_path, 10, FILES)
    (staged / "config.json").write_bytes(b"{ changed }")
    with pytest.raises(ValueError, match="does not match its manifest"):
        commit_checkpoint(staged, store, RUN)
    assert list_checkpoints(store, RUN) == []
