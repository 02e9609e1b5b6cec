"""Resuming from the store with real torchrun segments: the work dir is a cache.

Each test trains the tiny model in two segments through the segment task's
function (`train_segment_fn`) and the state upload's (`upload_state_fn`), deletes or spoils the local
cache between them, and compares the final training state with a run that kept its work
dir, byte for byte (the sha256 of every file of the stored state).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from infra.runs.run_state import read_bundle_manifest
from infra.store import open_store
from infra.store.verified import StoredObjectCorrupt
from tasks import run_state
from tasks.plan import plan_run_fn
from tasks.segment import train_segment_fn
from tasks.state_upload import upload_state_fn
from tests.conftest import EXAMPLES, tiny_tree
from tests.publication_helpers import fail_after_uploads
from tests.state_helpers import train_and_store
from trainer_core.config import config_from_dict
from trainer_core.run.faults import FAULT_KIND_ENV, UPLOAD_FAULT_ENV

pytestmark = [pytest.mark.distributed]

SFT: dict = {"train": {"nproc_per_node": 1}}
RL: dict = {
    "train": {"nproc_per_node": 1},
    "data": {"path": str(EXAMPLES / "tiny" / "rl.jsonl"), "kind": "rl", "pack": True},
    "rl": {"initial_policy_version": 3, "max_data_staleness": 3, "sft_coef": 0.1},
}
QUIET = {"on_line": lambda _: None}
UPLOAD = (
    "import sys; from tasks.outcomes import PlannedRun; from tasks.state_upload import upload_state_fn; "
    "upload_state_fn(PlannedRun.model_validate_json(sys.argv[1]), 0)"
)


def plan_in(root: Path, sections: dict, storage_url: str | None = None):
    tree = tiny_tree(root, **sections)
    if storage_url is not None:
        tree["storage"]["url"] = storage_url
    return plan_run_fn(config_from_dict(tree, config_dir=root))


def final_state_digests(planned) -> dict[str, object]:
    """sha256 of every file of the last segment's stored state (weights, AdamW state, meta).

    The result file names local paths and is left out; of each checkpoint's
    version.json the identity is left out (a fresh one per process, by
    design: graphs from before a restore are void) and the rest compared.
    """
    store = open_store(planned.storage)
    manifest = read_bundle_manifest(store, planned.run_id, f"segment-{planned.num_segments - 1:04d}")
    assert manifest is not None, "the last segment's state is not in the store"
    digests: dict[str, object] = {}
    for entry in manifest.files:
        if entry.path.endswith("/version.json"):
            version = json.loads(store.fs.cat_file(store.path(planned.run_id, entry.path)))
            digests[entry.path] = {k: v for k, v in version.items() if k != "identity"}
        elif entry.path.startswith("state/"):
            digests[entry.path] = entry.sha256
    assert any(path.endswith("params.safetensors") for path in digests)
    return digests


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final state digests of runs that kept their work dir, per data kind."""
    digests = {}
    for kind, sections in (("sft", SFT), ("rl", RL)):
        planned = plan_in(tmp_path_factory.mktemp(f"reference-{kind}"), sections)
        for index in range(planned.num_segments):
            train_and_store(planned, index, **QUIET)
        digests[kind] = final_state_digests(planned)
    return digests


@pytest.mark.parametrize("kind, sections", [("sft", SFT), ("rl", RL)])
def test_the_run_dir_deleted_between_segments_resumes_bitwise_from_the_store(reference, tmp_path, kind, sections):
    planned = plan_in(tmp_path, sections)
    first = train_and_store(planned, 0, **QUIET)
    shutil.rmtree(planned.run_dir)
    second = train_and_store(planned, 1, **QUIET)
    assert not first.reused and not second.reused
    assert final_state_digests(planned) == reference[kind]
    assert (Path(planned.run_dir) / "state/segment-0000/meta.json").is_file()  # fetched into the cache


def test_a_fresh_worker_with_another_work_dir_resumes_bitwise(reference, tmp_path):
    planned = plan_in(tmp_path / "worker-a", SFT)
    train_and_store(planned, 0, **QUIET)
    shutil.rmtree(tmp_path / "worker-a" / "work")  # the whole work dir: run dir, stage cache, logs
    fresh = planned.model_copy(update={"run_dir": str(tmp_path / "worker-b" / "work" / planned.run_id)})
    train_and_store(fresh, 1, **QUIET)
    assert final_state_digests(fresh) == reference["sft"]
    # The segment trained before is reused from the store by the fresh worker: nothing launched.
    assert train_segment_fn(fresh, 0, **QUIET).reused


def test_an_interrupted_state_upload_is_not_used_and_the_retry_completes_it(reference, tmp_path, monkeypatch):
    planned = plan_in(tmp_path, SFT)
    train_segment_fn(planned, 0, **QUIET)  # the state is durable here; its upload fails after one file
    real_publish = run_state.publish_bundle
    monkeypatch.setattr(
        run_state,
        "publish_bundle",
        lambda *args, **kwargs: real_publish(
            *args, **{**kwargs, "observer": fail_after_uploads(1, ConnectionError("injected storage outage"))}
        ),
    )
    with pytest.raises(ConnectionError, match="injected"):
        upload_state_fn(planned, 0)
    monkeypatch.setattr(run_state, "publish_bundle", real_publish)
    fresh = planned.model_copy(update={"run_dir": str(tmp_path / "elsewhere" / planned.run_id)})
    with pytest.raises(FileNotFoundError, match="segment-0000.json is missing"):
        train_segment_fn(fresh, 1, **QUIET)  # the partial upload is not resumed from
    retried = train_segment_fn(planned, 0, **QUIET)
    assert retried.reused  # trained already: only the upload is left, and its retry finishes it
    assert not upload_state_fn(planned, 0)["already_stored"]
    train_and_store(fresh, 1, **QUIET)
    assert final_state_digests(fresh) == reference["sft"]


def test_a_state_upload_killed_while_the_next_segment_trains_loses_nothing(reference, tmp_path):
    planned = plan_in(tmp_path, SFT)
    train_segment_fn(planned, 0, **QUIET)
    marker = tmp_path / "upload-fault"
    uploader = subprocess.run(  # the process uploading segment 0 is SIGKILLed after its first data file
        [sys.executable, "-c", UPLOAD, planned.model_dump_json()],
        env={**os.environ, UPLOAD_FAULT_ENV: f"0:{marker}", FAULT_KIND_ENV: "kill"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert uploader.returncode == -signal.SIGKILL and marker.is_file(), uploader.stderr[-2000:]
    store = open_store(planned.storage)
    assert store.fs.find(store.path(planned.run_id, "state/segment-0000"))  # some data objects landed
    assert read_bundle_manifest(store, planned.run_id, "segment-0000") is None  # the bundle was never published
    with pytest.raises(FileNotFoundError, match="segment-0000.json is missing"):
        run_state.fetch_segment_state(planned, 0, stored_only=True)  # no checkpoint is exported from it
    second = train_segment_fn(planned, 1, **QUIET)  # the next segment starts from the local state at once
    assert not second.reused
    # The rerun: segment 0 is trained here (reused), its upload finishes; then segment 1's.
    assert train_segment_fn(planned, 0, **QUIET).reused
    assert not upload_state_fn(planned, 0)["already_stored"]
    upload_state_fn(planned, 1)
    assert final_state_digests(planned) == reference["sft"]


def test_a_corrupt_local_state_is_downloaded_again_and_a_corrupt_stored_one_is_named(reference, tmp_path):
    planned = plan_in(tmp_path, SFT)
    train_and_store(planned, 0, **QUIET)
    store = open_store(planned.storage)
    params = "state/segment-0000/base/params.safetensors"
    cached = Path(planned.run_dir) / params
    # A new file in its place: a local store on this filesystem took the saved file by hard link, so a write in
    # place would spoil both copies (tests/unit/test_state_record.py: the store's own check catches that).
    spoiled = cached.with_name("spoiled")
    spoiled.write_bytes(cached.read_bytes()[:-1] + bytes([cached.read_bytes()[-1] ^ 1]))
    spoiled.replace(cached)
    stored_path = store.path(planned.run_id, params)
    good = store.fs.cat_file(stored_path)
    store.fs.pipe_file(stored_path, good[:100] + bytes([good[100] ^ 0xFF]) + good[101:])
    fresh = planned.model_copy(update={"run_dir": str(tmp_path / "fresh" / planned.run_id)})
    with pytest.raises(StoredObjectCorrupt, match=f"{planned.run_id}/{params}.*corrupt"):
        train_segment_fn(fresh, 1, **QUIET)
    assert not (Path(fresh.run_dir) / params).exists()
    store.fs.pipe_file(stored_path, good)  # the store repaired: the spoiled local copy is replaced, not trusted
    train_and_store(planned, 1, **QUIET)
    assert cached.read_bytes() == good
    assert final_state_digests(planned) == reference["sft"]


@pytest.mark.s3
def test_on_s3_a_deleted_work_dir_resumes_training_and_export_from_the_store(
    reference, tmp_path, s3_env, s3_bucket_url
):
    from tasks.export import export_segment_fn

    planned = plan_in(tmp_path, SFT, storage_url=s3_bucket_url)
    train_and_store(planned, 0, **QUIET)
    shutil.rmtree(tmp_path / "work")
    train_and_store(planned, 1, **QUIET)
    assert final_state_digests(planned) == reference["sft"]
    shutil.rmtree(tmp_path / "work")
    exported = export_segment_fn(planned, 1, **QUIET)
    assert exported.step == planned.total_steps and (Path(exported.staged_dir) / "MANIFEST.json").is_file()


ONE_STEP_SEGMENTS: dict = {"train": {"nproc_per_node": 1, "steps": 3, "steps_per_segment": 1}}


def test_a_resume_after_retention_removed_the_older_states_is_bitwise(tmp_path):
    """Three one-step segments: once segment 1's state is the newest, retention removes segment 0's (store and cache);
    segment 2 then resumes on an empty work dir from the store, bitwise as a run that kept everything."""
    from infra.publication.finalizer import FinalizerSettings
    from infra.publication.retention import RetentionPolicy, apply_retention
    from tasks.retention import segment_states

    kept = plan_in(tmp_path / "kept", ONE_STEP_SEGMENTS)
    for index in range(kept.num_segments):
        train_and_store(kept, index, **QUIET)
    planned = plan_in(tmp_path / "retained", ONE_STEP_SEGMENTS)
    train_and_store(planned, 0, **QUIET)
    train_and_store(planned, 1, **QUIET)
    store = open_store(planned.storage)
    report = apply_retention(
        store, planned.run_id, RetentionPolicy(keep_states=False), FinalizerSettings(), segment_states(planned, 2)
    )
    assert report.states_removed == [0] and not (Path(planned.run_dir) / "state/segment-0000").exists()
    assert not store.fs.exists(store.path(planned.run_id, "state/segment-0000"))
    shutil.rmtree(planned.run_dir)
    assert not train_and_store(planned, 2, **QUIET).reused
    assert final_state_digests(planned) == final_state_digests(kept)
    assert train_segment_fn(planned, 0, **QUIET).reused  # its result stays: a rerun never trains it again
