"""The store is the truth, the work dir a cache: a second store, and a damaged committed checkpoint.

- the same command and work dir with another `storage.url` (local → local,
  local → S3) publishes the run to the new store, bitwise the same checkpoint,
  without training again: the journals of the first store are not the second's;
- a committed checkpoint whose bytes changed under it (one byte flipped, same
  size; on S3 rewritten keeping its metadata) is exported and committed again
  from the state in the store by the next run, which ends with a checkpoint
  that verifies byte for byte and equals the original — with the work dir kept
  and with it deleted;
- a commit that fails in a way a retry cannot change is not retried, and the
  run names the `commit` stage.

One run trains (module fixture); every test works on copies of its work dir and
store, so they are independent and nothing trains twice.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from flows.pipeline import RunFailed, train_flow
from infra.publication.checkpoints import verify_checkpoint
from infra.publication.manifests import ManifestError
from infra.runs import ledger
from infra.runs.run_state import stored_bundle
from infra.store import S3Store, open_store
from infra.store.s3_client import run_async
from tests.conftest import tiny_tree
from trainer_core.config import config_from_dict

pytestmark = [pytest.mark.flow, pytest.mark.distributed]

CHECKPOINT = "step-00000006"


@pytest.fixture(scope="module")
def trained(prefect_harness, tmp_path_factory):
    """A finished run on a local store: (its tmp dir, its result)."""
    root = tmp_path_factory.mktemp("truth")
    # Moving a run to another store without training needs every state in the work dir (docs/pipeline.md).
    config = config_from_dict(tiny_tree(root, storage={"keep_states": True}), config_dir=root)
    result = train_flow(config)
    assert result["status"] == "completed" and result["segments_trained"] == 2
    return root, result


def clone(trained, tmp_path: Path, *, store: bool = True) -> None:
    """A copy of the trained run's work dir (and store) at tmp_path/work (tmp_path/store)."""
    root, _ = trained
    shutil.copytree(root / "work", tmp_path / "work", symlinks=True)
    if store:
        shutil.copytree(root / "store", tmp_path / "store", symlinks=True)


def config_for(tmp_path: Path, storage_url: str):
    return config_from_dict(tiny_tree(tmp_path, storage={"url": storage_url, "keep_states": True}), config_dir=tmp_path)


def checkpoint_bytes(storage_url: str, run_id: str) -> dict[str, bytes]:
    """Every object of the run's checkpoint, as stored (manifest included)."""
    store = open_store(storage_url)
    base = store.key(run_id, "checkpoints", CHECKPOINT)
    return {path: store.get(f"{base}/{path}").data for path in sorted(store.list(base))}


def assert_complete_and_original(storage_url: str, trained) -> None:
    root, result = trained
    store = open_store(storage_url)
    report = verify_checkpoint(store, result["run_id"], CHECKPOINT, full=True)
    assert report.verified, report.problems
    assert checkpoint_bytes(storage_url, result["run_id"]) == checkpoint_bytes(str(root / "store"), result["run_id"])


def flip_one_byte(storage_url: str, run_id: str, file: str = "model.safetensors") -> None:
    """Change one byte of a committed object, same size; on S3 the object is rewritten keeping its metadata."""
    store = open_store(storage_url)
    key = store.key(run_id, "checkpoints", CHECKPOINT, file)
    data = bytearray(store.get(key).data)
    data[len(data) // 2] ^= 0x01
    if not isinstance(store, S3Store):  # rewriting bytes in place: a store-specific way of damaging them
        Path(store.path(key)).write_bytes(bytes(data))
        return
    location = dict(zip(("Bucket", "Key"), store.bucket_and_key(store.path(key))))

    def request(method: str, **kwargs) -> dict:
        return run_async(store, None, store._request, method, **location, **kwargs)

    metadata = request("head_object")["Metadata"]
    request("put_object", Body=bytes(data), Metadata=metadata)
    assert request("head_object")["Metadata"] == metadata


def assert_reran_without_training(result: dict, trained) -> None:
    _, first = trained
    assert result["status"] == "completed" and result["run_id"] == first["run_id"]
    assert result["segments_trained"] == 0 and result["launch_wall_s"] == 0 and result["losses"] == first["losses"]
    assert result["checkpoint_url"].endswith(CHECKPOINT)


def commit_failures(tmp_path: Path, run_id: str) -> list[dict]:
    return [e for e in ledger.read(tmp_path / "work" / run_id) if e["stage"] == "commit" and e["status"] == "failed"]


# -- a second store, the same work dir ---------------------------------------------------


def test_another_local_store_with_the_same_work_dir_gets_the_same_checkpoint_without_training(trained, tmp_path):
    clone(trained, tmp_path)
    other = str(tmp_path / "store-b")
    result = train_flow(config_for(tmp_path, other))
    assert_reran_without_training(result, trained)
    assert result["checkpoint_url"].startswith(other) and result["export_wall_s"] > 0  # exported for this store
    assert_complete_and_original(other, trained)
    store = open_store(other)
    assert all(stored_bundle(store, result["run_id"], f"segment-{i:04d}") is not None for i in range(2))
    assert commit_failures(tmp_path, result["run_id"]) == []
    # And back to the first store: its own records still say it is done, nothing is exported for it.
    again = train_flow(config_for(tmp_path, str(tmp_path / "store")))
    assert_reran_without_training(again, trained)
    assert again["export_wall_s"] == 0
    assert_complete_and_original(str(tmp_path / "store"), trained)


@pytest.mark.s3
def test_moving_from_a_local_store_to_s3_with_the_same_work_dir(trained, s3_env, s3_bucket_url, tmp_path):
    clone(trained, tmp_path)
    result = train_flow(config_for(tmp_path, s3_bucket_url))
    assert_reran_without_training(result, trained)
    assert result["checkpoint_url"].startswith(s3_bucket_url + "/")
    assert_complete_and_original(s3_bucket_url, trained)
    store = open_store(s3_bucket_url)
    assert all(stored_bundle(store, result["run_id"], f"segment-{i:04d}") is not None for i in range(2))
    assert commit_failures(tmp_path, result["run_id"]) == []


# -- a damaged committed checkpoint --------------------------------------------------------


def test_a_damaged_local_checkpoint_is_exported_and_committed_again(trained, tmp_path):
    clone(trained, tmp_path)
    url, run_id = str(tmp_path / "store"), trained[1]["run_id"]
    for _ in range(2):  # the second time, this work dir's own journal says the step is CLEANED
        flip_one_byte(url, run_id)
        assert not verify_checkpoint(open_store(url), run_id, CHECKPOINT).verified  # readers refuse it
        result = train_flow(config_for(tmp_path, url))
        assert_reran_without_training(result, trained)
        assert result["export_wall_s"] > 0
        assert_complete_and_original(url, trained)
    # With the work dir deleted: everything comes from the store.
    flip_one_byte(url, run_id)
    shutil.rmtree(tmp_path / "work")
    result = train_flow(config_for(tmp_path, url))
    assert_reran_without_training(result, trained)
    assert_complete_and_original(url, trained)


@pytest.mark.s3
def test_a_damaged_s3_checkpoint_with_its_metadata_kept_is_exported_and_committed_again(
    trained, s3_env, s3_bucket_url, tmp_path
):
    clone(trained, tmp_path, store=False)
    run_id = trained[1]["run_id"]
    train_flow(config_for(tmp_path, s3_bucket_url))  # the run, published to S3
    assert_complete_and_original(s3_bucket_url, trained)
    flip_one_byte(s3_bucket_url, run_id)
    # The quick check sees it: the bytes the store holds are not the ones rankflow uploaded.
    report = verify_checkpoint(open_store(s3_bucket_url), run_id, CHECKPOINT)
    assert not report.verified and "model.safetensors" in " ".join(report.problems)
    result = train_flow(config_for(tmp_path, s3_bucket_url))
    assert_reran_without_training(result, trained)
    assert result["export_wall_s"] > 0
    assert_complete_and_original(s3_bucket_url, trained)
    flip_one_byte(s3_bucket_url, run_id)
    shutil.rmtree(tmp_path / "work")
    result = train_flow(config_for(tmp_path, s3_bucket_url))
    assert_reran_without_training(result, trained)
    assert_complete_and_original(s3_bucket_url, trained)


# -- a commit error a retry cannot change ---------------------------------------------------


def test_a_commit_error_a_retry_cannot_change_is_not_retried_and_names_the_commit_stage(trained, tmp_path, monkeypatch):
    import tasks.publish

    clone(trained, tmp_path)

    def refuse(*args, **kwargs):
        raise ManifestError("MANIFEST.json: a manifest refused on purpose (the same on every try)")

    monkeypatch.setattr(tasks.publish, "commit_checkpoint", refuse)
    with pytest.raises(RunFailed) as raised:
        train_flow(config_for(tmp_path, str(tmp_path / "store-b")))
    summary = raised.value.summary
    assert summary["failed_stage"] == "commit" and summary["failure_cause"] == "bad_input"
    assert len(commit_failures(tmp_path, summary["run_id"])) == 1  # one attempt: not retried
