"""The publication protocol against the real SeaweedFS: conditional writes, digests in metadata,
racing committers in separate processes, FIFO, scoped cleanup of multipart uploads.

Tests marked "defect:" fail on the commit before the journal (LATEST read and
written without a condition; cleanup aborting every upload of the run, with a
prefix that had no trailing '/'; retries by size only).
"""

from __future__ import annotations

import json

import pytest

from infra.publication.checkpoints import list_checkpoints, verify_checkpoint
from infra.publication.cleanup import cleanup_staging
from infra.publication.commit import PublishSettings, StagedFileChanged, commit_checkpoint
from infra.publication.finalizer import FINALIZER_LEASE
from infra.publication.journal import journal_path_for, read_mirrors
from infra.publication.latest import read_latest
from infra.store import S3Store, open_store
from infra.store.conditional import (
    ConditionalWritesUnsupported,
    check_conditional_writes,
    create_if_absent,
    read_versioned,
    replace_if_unchanged,
)
from infra.store.lease import Lease
from infra.store.objects import SHA256_METADATA_KEY
from tests.publication_helpers import RUN, random_files, same_size_other_bytes, stage
from tests.storage.processes import result, spawn, wait_ready
from tests.waits import wait_for
from trainer_core.run.manifest import write_manifest

pytestmark = pytest.mark.s3


@pytest.fixture
def store(s3_env, s3_bucket_url):
    return open_store(s3_bucket_url)


def test_seaweedfs_honours_conditional_puts(store):
    path = store.path("conditional", "object")
    first = create_if_absent(store, path, b"one")
    assert first is not None and create_if_absent(store, path, b"two") is None
    assert read_versioned(store, path).data == b"one"
    second = replace_if_unchanged(store, path, b"three", first)
    assert second is not None and replace_if_unchanged(store, path, b"four", first) is None
    assert read_versioned(store, path).data == b"three"
    check_conditional_writes(store, store.key("conditional"))


def test_a_store_that_ignores_conditions_is_refused(store, monkeypatch):
    real = S3Store._request

    async def ignoring_conditions(self, method, **kwargs):
        kwargs.pop("IfNoneMatch", None)
        kwargs.pop("IfMatch", None)
        return await real(self, method, **kwargs)

    monkeypatch.setattr(S3Store, "_request", ignoring_conditions)
    monkeypatch.setattr("infra.store.conditional._VERIFIED_STORES", set())  # forget earlier tests' probes
    with pytest.raises(ConditionalWritesUnsupported, match="ignores conditional writes"):
        check_conditional_writes(store, store.key("probe"))


def test_uploads_carry_their_sha256_and_a_recommit_only_heads(store, tmp_path, monkeypatch):
    staged = stage(tmp_path, 10, random_files(3, 200_000))
    commit_checkpoint(staged, store, RUN)
    bucket, key = store.bucket_and_key(store.path(RUN, "checkpoints", "step-00000010", staged.name))
    manifest = json.loads((staged / "MANIFEST.json").read_text())
    for entry in manifest["files"]:
        bucket, key = store.bucket_and_key(store.path(RUN, "checkpoints", "step-00000010", entry["path"]))
        head = store.fs.call_s3("head_object", Bucket=bucket, Key=key)
        assert head["Metadata"][SHA256_METADATA_KEY] == entry["sha256"]
    # No journal at all (the work dir and the mirror lost, or a checkpoint committed by an older
    # rankflow): every object is checked, and a HEAD per object suffices, nothing is downloaded.
    journal_path_for(staged, store).unlink()
    store.fs.rm_file(store.path(RUN, "publications", "step-00000010.json"))
    calls = []
    real = store.fs._call_s3

    read_keys = []

    async def counting(method, *args, **kwargs):
        calls.append(method)
        if method == "get_object":
            read_keys.append(kwargs["Key"])
        return await real(method, *args, **kwargs)

    monkeypatch.setattr(store.fs, "_call_s3", counting)
    again = commit_checkpoint(staged, store, RUN)
    assert again.num_files_uploaded == 0 and again.bytes_uploaded == 0 and not again.already_committed
    assert calls.count("head_object") >= 3 and "upload_part" not in calls
    # get_object only reads small control objects (LATEST, the lease, journals, the published manifest).
    data_files = {entry["path"] for entry in manifest["files"]}
    assert read_keys and not [key for key in read_keys if key.rsplit("/", 1)[-1] in data_files]


def test_defect_same_size_other_bytes_are_uploaded_again(store, tmp_path):
    staged = stage(tmp_path, 10, random_files(2, 50_000))
    stop = []

    def crash_after_first(event):
        if event.startswith("uploaded "):
            stop.append(event)
            # An Exception, not KeyboardInterrupt: that would stop fsspec's event-loop thread for good.
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        commit_checkpoint(staged, store, RUN, settings=PublishSettings(concurrency=1), observer=crash_after_first)
    for path in staged.glob("*.safetensors"):
        same_size_other_bytes(path)
    write_manifest(staged, {"run_id": RUN, "step": 10})
    retried = commit_checkpoint(staged, store, RUN)
    assert retried.num_files_uploaded == 2
    assert verify_checkpoint(store, RUN, "step-00000010", full=True).verified


def _start_upload(store, *parts: str) -> str:
    bucket, key = store.bucket_and_key(store.path(*parts))
    return store.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]


def _open_uploads(store) -> set[str]:
    bucket, _ = store.bucket_and_key(store.root)
    listed = store.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=store.bucket_and_key(store.root + "/")[1])
    return {
        upload["Key"].rsplit("/", 2)[-2] + "/" + upload["Key"].rsplit("/", 1)[-1]
        for upload in listed.get("Uploads", [])
    }


def test_defect_cleanup_aborts_only_this_checkpoints_uploads(store, tmp_path):
    staged = stage(tmp_path, 10, random_files(2, 10_000))
    commit_checkpoint(staged, store, RUN)
    _start_upload(store, RUN, "checkpoints", "step-00000010", "dangling.safetensors")  # a killed uploader's
    _start_upload(store, RUN, "checkpoints", "step-00000020", "in-flight.safetensors")  # a concurrent commit's
    _start_upload(store, RUN, "checkpoints", "step-000000100", "sibling.safetensors")  # shares the prefix, no '/'
    _start_upload(store, RUN + "X", "checkpoints", "step-00000010", "other-run.safetensors")
    outcome = cleanup_staging(staged, store, RUN)
    assert outcome.aborted_uploads == 1
    assert _open_uploads(store) == {
        "step-00000020/in-flight.safetensors",
        "step-000000100/sibling.safetensors",
        "step-00000010/other-run.safetensors",
    }


def _say(committer, line: str) -> None:
    committer.stdin.write(f"{line}\n")
    committer.stdin.flush()


def _wait_held(committer, event: str) -> None:
    """Until the committer says it is held at `event` (tests/storage/committer.py --hold)."""
    line = committer.stdout.readline().strip()
    assert line == f"held at {event}", f"{line!r} {committer.stderr.read()[-2000:] if not line else ''}"


def test_defect_two_committers_in_two_processes_never_move_latest_back(store, tmp_path, s3_bucket_url):
    older, newer = stage(tmp_path, 10, random_files(2, 20_000)), stage(tmp_path, 20, random_files(2, 20_000))
    # The older commit is held between reading and writing LATEST, the window that used to lose the race, until the
    # newer one is waiting for the finalizer behind it.
    slow = spawn("tests.storage.committer", [str(older), RUN, s3_bucket_url, "--hold", "latest-read", "--wait-go"])
    fast = spawn("tests.storage.committer", [str(newer), RUN, s3_bucket_url, "--wait-go"])
    wait_ready(slow), wait_ready(fast)
    _say(slow, "go"), _wait_held(slow, "latest-read")
    _say(fast, "go")
    wait_for(lambda: store.fs.exists(store.path(RUN, "finalizer-queue", "step-00000020.json")), "step 20 to queue")
    _say(slow, "on")
    slow_result, fast_result = result(slow), result(fast)
    assert read_latest(store, RUN) == {"checkpoint": "step-00000020", "step": 20}
    assert fast_result["started"] < slow_result["ended"] <= fast_result["ended"]  # they overlapped; one waited
    assert list_checkpoints(store, RUN) == ["step-00000010", "step-00000020"]


def test_defect_latest_compare_and_swap_holds_without_the_lease(store, tmp_path, s3_bucket_url):
    for step in (10, 20):
        commit_checkpoint(stage(tmp_path, step, random_files(1, 1000)), store, RUN)
    store.fs.rm_file(store.path(RUN, "LATEST"))  # both checkpoints exist; LATEST is up for grabs
    slow = spawn(
        "tests.storage.committer",
        ["-", RUN, s3_bucket_url, "--latest-only", "10", "--hold", "latest-read", "--wait-go"],
    )
    fast = spawn("tests.storage.committer", ["-", RUN, s3_bucket_url, "--latest-only", "20", "--wait-go"])
    wait_ready(slow), wait_ready(fast)
    _say(slow, "go"), _wait_held(slow, "latest-read")  # it has read LATEST (absent) and not yet written it
    _say(fast, "go")
    fast_result = result(fast)  # moved LATEST to 20 while the slow one was held
    _say(slow, "on")
    slow_result = result(slow)
    assert fast_result["moved"] and fast_result["ended"] < slow_result["ended"]
    # The slow one's write lost its condition, it read again and found 20: no move back.
    assert (slow_result["moved"], slow_result["step"]) == (False, 20)
    assert read_latest(store, RUN)["step"] == 20


def test_checkpoints_become_visible_in_step_order(store, tmp_path, s3_bucket_url):
    steps = (30, 20, 10)  # committers arrive newest first
    staged = {step: stage(tmp_path, step, random_files(1, 10_000)) for step in steps}
    blocker = Lease.for_run(store, RUN, FINALIZER_LEASE, owner="test-holder", ttl_s=60)
    blocker.acquire()
    committers = []
    for step in steps:
        committer = spawn("tests.storage.committer", [str(staged[step]), RUN, s3_bucket_url])
        wait_ready(committer)
        committers.append(committer)
        queued = store.path(RUN, "finalizer-queue", f"step-{step:08d}.json")
        wait_for(lambda: store.fs.exists(queued), f"step {step} to start waiting")  # noqa: B023
    blocker.release()
    outcomes = [result(c) for c in committers]
    committed_at = {}
    for record in read_mirrors(store, RUN)[0]:
        committed_at[record.step] = next(h.time for h in record.history if h.state == "COMMITTED")
    assert sorted(committed_at, key=committed_at.get) == [10, 20, 30]
    assert all(o["latest_moved"] for o in outcomes) and read_latest(store, RUN)["step"] == 30


@pytest.mark.parametrize("server_verifies", [True, False])
def test_a_staged_file_spoiled_after_export_is_refused(store, tmp_path, monkeypatch, server_verifies):
    """SeaweedFS checks x-amz-checksum-sha256 itself; a server that does not gets the bytes hashed by the client."""
    from infra.store import s3_uploads

    monkeypatch.setattr(s3_uploads, "_VERIFYING_ENDPOINTS", {})
    if not server_verifies:
        real = S3Store._request

        async def checksum_ignored(self, method, **kwargs):
            if method == "put_object":
                kwargs.pop("ChecksumSHA256", None)  # a server that never looks at the checksum
            return await real(self, method, **kwargs)

        monkeypatch.setattr(S3Store, "_request", checksum_ignored)
    staged = stage(tmp_path, 10, random_files(2, 40_000))
    same_size_other_bytes(sorted(staged.glob("*.safetensors"))[1])
    with pytest.raises(StagedFileChanged, match="no longer matches its manifest"):
        commit_checkpoint(staged, store, RUN)
    assert s3_uploads._VERIFYING_ENDPOINTS[store.fs.endpoint_url] is server_verifies
    assert list_checkpoints(store, RUN) == [] and read_latest(store, RUN) is None
    assert not store.fs.exists(store.path(RUN, "checkpoints", "step-00000010", "MANIFEST.json"))
