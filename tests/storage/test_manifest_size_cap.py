"""A hostile 100 MiB manifest is refused by its size, before it is read (issue 31, item 10).

Every reader of a stored manifest (a checkpoint's, a run-state bundle's) and of a reader marker is given one
100 MiB file of zeros (sparse: it costs no disk) in place of the record; each refuses it, or ignores it where an
unreadable record is ignored, while the memory Python allocates stays under 2 MiB (reading it whole held 100 MiB
before parsing failed). The writers that compare the stored manifest with theirs (a commit, a bundle upload) hide
it unread and write their own.
"""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from flows.cli import main
from infra.publication.checkpoints import download_checkpoint, resolve_latest, verify_checkpoint
from infra.publication.commit import commit_checkpoint
from infra.publication.manifests import MAX_MANIFEST_BYTES, ManifestError
from infra.publication.readers import live_readers
from infra.runs.run_state import publish_bundle, read_bundle_manifest
from infra.store import open_store
from tests.publication_helpers import RUN, random_files, stage

HOSTILE_BYTES = 100 * 2**20
PEAK_BYTES = 2 * 2**20


def plant(path: Path, size: int = HOSTILE_BYTES) -> None:
    """A file of `size` zero bytes at `path` (sparse)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        handle.truncate(size)


def peak_bytes(call: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture
def store_dir(tmp_path) -> Path:
    store = open_store(str(tmp_path / "store"))
    commit_checkpoint(stage(tmp_path, 10, random_files(2, 3000)), store, RUN)
    plant(tmp_path / "store" / RUN / "checkpoints" / "step-00000010" / "MANIFEST.json")
    return tmp_path / "store"


def test_the_readers_of_a_checkpoint_refuse_a_hostile_manifest_unread(store_dir, tmp_path, capsys):
    store = open_store(str(store_dir))
    too_large = f"{HOSTILE_BYTES} bytes, more than the {MAX_MANIFEST_BYTES} a record of this kind may take"
    found: list = []
    assert peak_bytes(lambda: found.append(verify_checkpoint(store, RUN, "step-00000010", full=True))) < PEAK_BYTES
    assert peak_bytes(lambda: found.append(resolve_latest(store, RUN))) < PEAK_BYTES
    report, resolution = found
    assert not report.verified and report.problems[0].startswith("manifest refused") and too_large in report.problems[0]
    assert resolution.checkpoint is None

    def pull() -> None:
        with pytest.raises(ManifestError, match=too_large):
            download_checkpoint(store, RUN, "step-00000010", tmp_path / "pulled")

    assert peak_bytes(pull) < PEAK_BYTES and not (tmp_path / "pulled").exists()
    # The eval's verified fetch refuses it too: the store's damage, exit 1 (as pull of it).
    data = tmp_path / "eval.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    )
    assert main(["eval", f"{store_dir}/{RUN}/checkpoints/step-00000010", "--data", str(data)]) == 1
    assert too_large in capsys.readouterr().err


def test_a_commit_over_a_hostile_manifest_replaces_it_unread(store_dir, tmp_path):
    store = open_store(str(store_dir))
    staged = stage(tmp_path / "again", 10, random_files(2, 3000))
    outcome = commit_checkpoint(staged, store, RUN)
    assert verify_checkpoint(store, RUN, "step-00000010", full=True).verified, outcome
    assert (store_dir / RUN / "checkpoints" / "step-00000010" / "MANIFEST.json").stat().st_size < MAX_MANIFEST_BYTES


def test_a_hostile_bundle_manifest_is_refused_unread_and_an_upload_replaces_it(tmp_path):
    store = open_store(str(tmp_path / "store"))
    hostile = tmp_path / "store" / RUN / "run-state" / "segment-0000.json"
    plant(hostile)
    with pytest.raises(ManifestError, match=f"{HOSTILE_BYTES} bytes, more than"):
        read_bundle_manifest(store, RUN, "segment-0000")
    tracemalloc.start()
    try:
        with pytest.raises(ManifestError):
            read_bundle_manifest(store, RUN, "segment-0000")
        assert tracemalloc.get_traced_memory()[1] < PEAK_BYTES
    finally:
        tracemalloc.stop()
    run_dir = tmp_path / "work" / RUN
    (run_dir / "plan.json").parent.mkdir(parents=True)
    (run_dir / "plan.json").write_bytes(b'{"plan": 1}')
    publish_bundle(store, RUN, run_dir, "segment-0000", ["plan.json"])
    manifest = read_bundle_manifest(store, RUN, "segment-0000")
    assert manifest is not None and [entry.path for entry in manifest.files] == ["plan.json"]


def test_a_hostile_reader_marker_counts_as_unreadable_unread(store_dir):
    store = open_store(str(store_dir))
    plant(store_dir / RUN / "readers" / "step-00000010" / "hostile.json")
    (store_dir / RUN / "readers" / "step-00000010" / "live.json").write_text(
        json.dumps({"owner": "me", "expires_at": 4e9, "ttl_s": 60.0})
    )
    assert peak_bytes(lambda: live_readers(store, RUN, "step-00000010")) < PEAK_BYTES
    assert live_readers(store, RUN, "step-00000010") == ["me"]


def test_the_cap_is_far_above_a_real_manifest():
    """A real checkpoint lists hundreds of files, a sharded state's bundle one per rank and checkpoint: 10,000
    entries of long names take a tenth of the cap."""
    entry = {"path": "model-00001-of-01000.safetensors" + "x" * 60, "size": 2**40, "sha256": "f" * 64}
    assert len(json.dumps({"files": [entry] * 10_000}, indent=2)) < MAX_MANIFEST_BYTES / 4
