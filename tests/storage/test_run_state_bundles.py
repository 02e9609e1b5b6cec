"""Run-state bundles (infra/runs/run_state.py) on a local store and on the real SeaweedFS server.

Checks real effects: bytes in the store and in the cache, the manifest's
absence after an interrupted upload, what a retry uploads again, a corrupt
object named in the error, the memory a large download holds, and that
`rankflow checkpoints gc` leaves run state alone.
"""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import pytest

from infra.publication.manifests import ManifestError
from infra.publication.orphans import collect_garbage
from infra.runs.run_state import fetch_bundle, manifest_path, publish_bundle, read_bundle_manifest, stored_bundle
from infra.store import open_store
from infra.store.verified import BLOCK_BYTES, StoredObjectCorrupt
from tests.publication_helpers import fail_after_uploads, same_size_other_bytes

RUN = "run-state-test"
FILES = {
    "plan.json": b'{"plan": 1}',
    "plan/segment-0000.safetensors": os.urandom(3000),
    "state/segment-0000/base/params.safetensors": os.urandom(5000),
    "segments/segment-0000.json": b"{}",
}


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def store(request, tmp_path):
    if request.param == "file":
        return open_store(f"file://{tmp_path / 'store'}")
    request.getfixturevalue("s3_env")
    return open_store(request.getfixturevalue("s3_bucket_url"))


def write_run_dir(root: Path, files: dict[str, bytes] = FILES) -> Path:
    for relative, data in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(data)
    return root


def read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_bundle_published_from_one_work_dir_is_fetched_into_an_empty_one(store, tmp_path):
    source = write_run_dir(tmp_path / "worker-a")
    figures = publish_bundle(store, RUN, source, "segment-0000", FILES)
    assert figures["num_files_uploaded"] == len(FILES)
    assert (
        store.fs.cat_file(store.path(RUN, "state/segment-0000/base/params.safetensors"))
        == FILES["state/segment-0000/base/params.safetensors"]
    )
    fresh = tmp_path / "worker-b"
    fetched = fetch_bundle(store, RUN, fresh, "segment-0000")
    assert read_tree(fresh) == FILES and fetched["num_files_fetched"] == len(FILES)
    # Everything verifies now: nothing is downloaded again, and a republish uploads nothing.
    assert fetch_bundle(store, RUN, fresh, "segment-0000")["num_files_fetched"] == 0
    assert publish_bundle(store, RUN, source, "segment-0000", FILES)["num_files_uploaded"] == 0


def test_a_corrupt_local_copy_is_replaced_by_the_stored_bytes(store, tmp_path):
    source = write_run_dir(tmp_path / "worker")
    publish_bundle(store, RUN, source, "segment-0000", FILES)
    cached = source / "state/segment-0000/base/params.safetensors"
    same_size_other_bytes(cached)
    (source / "plan.json").unlink()
    fetched = fetch_bundle(store, RUN, source, "segment-0000")
    assert fetched["num_files_fetched"] == 2 and fetched["num_files_kept"] == len(FILES) - 2
    assert read_tree(source) == FILES


def test_a_symlinked_directory_in_the_run_dir_is_replaced_never_written_through(store, tmp_path):
    source = write_run_dir(tmp_path / "worker")
    publish_bundle(store, RUN, source, "segment-0000", FILES)
    fresh = tmp_path / "fresh"
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "base").mkdir(parents=True)
    (elsewhere / "base" / "params.safetensors").write_bytes(b"another run's bytes")
    (fresh / "state").mkdir(parents=True)
    (fresh / "state" / "segment-0000").symlink_to(elsewhere, target_is_directory=True)
    fetch_bundle(store, RUN, fresh, "segment-0000")
    assert not (fresh / "state" / "segment-0000").is_symlink() and read_tree(fresh) == FILES
    assert (elsewhere / "base" / "params.safetensors").read_bytes() == b"another run's bytes"  # untouched


def test_a_corrupt_stored_object_is_named_and_never_used(store, tmp_path):
    publish_bundle(store, RUN, write_run_dir(tmp_path / "worker"), "segment-0000", FILES)
    damaged = store.path(RUN, "state/segment-0000/base/params.safetensors")
    data = bytearray(store.fs.cat_file(damaged))
    data[100] ^= 0xFF
    store.fs.pipe_file(damaged, bytes(data))
    fresh = tmp_path / "fresh"
    with pytest.raises(StoredObjectCorrupt, match="state/segment-0000/base/params.safetensors.*corrupt"):
        fetch_bundle(store, RUN, fresh, "segment-0000")
    assert not (fresh / "state/segment-0000/base/params.safetensors").exists()
    assert stored_bundle(store, RUN, "segment-0000") is None  # the quick check refuses it too


def test_an_interrupted_upload_is_never_used_and_its_retry_uploads_only_the_rest(store, tmp_path):
    source = write_run_dir(tmp_path / "worker")
    with pytest.raises(ConnectionError, match="injected"):
        publish_bundle(
            store,
            RUN,
            source,
            "segment-0000",
            FILES,
            observer=fail_after_uploads(2, ConnectionError("injected storage outage")),
        )
    assert read_bundle_manifest(store, RUN, "segment-0000") is None
    assert stored_bundle(store, RUN, "segment-0000") is None
    with pytest.raises(FileNotFoundError, match="run-state/segment-0000.json is missing.*partial upload is never used"):
        fetch_bundle(store, RUN, tmp_path / "fresh", "segment-0000")
    assert not (tmp_path / "fresh").exists()
    retried = publish_bundle(store, RUN, source, "segment-0000", FILES)
    assert retried["num_files_skipped"] >= 2 and retried["num_files_uploaded"] <= len(FILES) - 2
    fetch_bundle(store, RUN, tmp_path / "fresh", "segment-0000")
    assert read_tree(tmp_path / "fresh") == FILES


def test_a_changed_bundle_hides_its_old_manifest_before_its_objects_change(store, tmp_path):
    source = write_run_dir(tmp_path / "worker")
    publish_bundle(store, RUN, source, "segment-0000", FILES)
    changed = {**FILES, "segments/segment-0000.json": b'{"retrained": true}'}
    write_run_dir(source, changed)
    with pytest.raises(ConnectionError):
        publish_bundle(
            store,
            RUN,
            source,
            "segment-0000",
            changed,
            observer=fail_after_uploads(1, ConnectionError("injected storage outage")),
        )
    assert read_bundle_manifest(store, RUN, "segment-0000") is None  # neither the old nor a mixed bundle is visible
    publish_bundle(store, RUN, source, "segment-0000", changed)
    fetch_bundle(store, RUN, tmp_path / "fresh", "segment-0000")
    assert read_tree(tmp_path / "fresh") == changed


def test_a_hostile_manifest_cannot_write_outside_the_work_dir(store, tmp_path):
    entry = {"path": "../escaped", "size": 1, "sha256": "0" * 64}
    store.fs.pipe_file(
        manifest_path(store, RUN, "segment-0000"),
        json.dumps(
            {"format": "rankflow-run-state/1", "run_id": RUN, "bundle": "segment-0000", "files": [entry]}
        ).encode(),
    )
    with pytest.raises(ManifestError, match="leaves"):
        fetch_bundle(store, RUN, tmp_path / "work", "segment-0000")
    other_run = {"format": "rankflow-run-state/1", "run_id": "another-run", "bundle": "segment-0000", "files": []}
    store.fs.pipe_file(manifest_path(store, RUN, "segment-0000"), json.dumps(other_run).encode())
    with pytest.raises(ManifestError, match="another-run"):
        fetch_bundle(store, RUN, tmp_path / "work", "segment-0000")
    assert not (tmp_path / "escaped").exists()


def test_a_large_state_streams_through_a_bounded_buffer(store, tmp_path):
    size = 12 * BLOCK_BYTES + 12345  # 48 MiB: a whole-file read would hold all of it
    source = tmp_path / "worker"
    big = source / "state/segment-0001/base/params.safetensors"
    big.parent.mkdir(parents=True)
    with big.open("wb") as handle:
        for _ in range(12):
            handle.write(os.urandom(BLOCK_BYTES))
        handle.write(os.urandom(12345))
    publish_bundle(store, RUN, source, "segment-0001", ["state/segment-0001/base/params.safetensors"])
    fresh = tmp_path / "fresh"
    tracemalloc.start()
    try:
        fetch_bundle(store, RUN, fresh, "segment-0001")
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"peak traced memory fetching {size} bytes: {peak_bytes} bytes")
    assert (fresh / "state/segment-0001/base/params.safetensors").stat().st_size == size
    assert peak_bytes < 4 * BLOCK_BYTES, f"the download held {peak_bytes} bytes at once for a {size}-byte object"


def test_garbage_collection_keeps_run_state(store, tmp_path):
    source = write_run_dir(tmp_path / "worker")
    publish_bundle(store, RUN, source, "segment-0000", FILES)
    before = {p: store.fs.cat_file(store.path(RUN, p)) for p in FILES}
    report = collect_garbage(store, RUN)
    assert not [path for path in report.removed if "/state/" in path or "/plan" in path or "run-state" in path]
    assert stored_bundle(store, RUN, "segment-0000") is not None
    assert {p: store.fs.cat_file(store.path(RUN, p)) for p in FILES} == before
