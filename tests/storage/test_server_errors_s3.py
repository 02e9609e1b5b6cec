"""Server errors (HTTP 5xx) between the real SeaweedFS and a commit (a loopback proxy replaces the answers).

A server that stops mid-request answers 500 InternalError: the request may
have been applied, the answer says it failed. Found by the CI run of stop 29:
the commit raised s3fs's bare `OSError [Errno 121] We encountered an internal
error`, naming no store, and the uploads it had not started yet went on after
it raised, past the release of the finalizer lease (asyncio.gather leaves
them running), so a writer without the lease still wrote checkpoint files;
an upload being recorded when the batch stopped went on writing the journal
from its thread after the error went up.

Reference: the bytes in the store against the staged files, and the proxy's
record of every request, in order.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from infra.launch.failures import FailureClass, classify_exception
from infra.publication.checkpoints import download_checkpoint, latest_checkpoint, list_checkpoints
from infra.publication.commit import PublishSettings, commit_checkpoint
from infra.store import open_store
from infra.store.base import StorageTimeoutError
from tests.storage.staging import stage_checkpoint
from trainer_core.run.manifest import write_manifest

pytestmark = pytest.mark.s3

RUN = "server-errors-run"
STEP = "step-00000008"


def _staged(tmp_path: Path) -> Path:
    return stage_checkpoint(tmp_path, RUN, 8, file_bytes=150_000)


def _first_upload_fails_every_attempt(proxy, s3_bucket_url: str, tmp_path: Path):
    """The store, a staged checkpoint, and the attempts after which model-00000's PUT (answered 500) fails."""
    store = open_store(s3_bucket_url)
    attempts = store.timeouts.max_attempts
    proxy.answer_error(_put_of("model-00000.safetensors"), status=500, code="InternalError", times=attempts)
    return store, _staged(tmp_path), attempts


def _put_of(name: str):
    return lambda request: request.method == "PUT" and request.path.endswith(f"/{STEP}/{name}")


def _assert_published_bitwise(store, staged: Path, into: Path) -> None:
    assert latest_checkpoint(store, RUN) == STEP
    copy = download_checkpoint(store, RUN, STEP, into)
    for file in staged.glob("*.safetensors"):
        assert (copy / file.name).read_bytes() == file.read_bytes()


def test_a_server_error_on_every_attempt_is_an_outage_naming_the_store_and_stops_every_upload(
    proxy, s3_bucket_url, tmp_path
):
    store, staged, attempts = _first_upload_fails_every_attempt(proxy, s3_bucket_url, tmp_path)
    with pytest.raises(OSError) as caught:
        commit_checkpoint(staged, store, RUN, settings=PublishSettings(concurrency=1))
    error = caught.value
    # Before: OSError "[Errno 121] injected by the test proxy", no store named.
    assert isinstance(error, ConnectionError), repr(error)
    assert "answered HTTP 500 on every attempt" in str(error) and s3_bucket_url in str(error)
    assert classify_exception(error) is FailureClass.STORAGE_OUTAGE and classify_exception(error).retriable
    assert len(proxy.applied) == attempts  # botocore tried every attempt, the answer was 500 each time

    time.sleep(1.0)  # before, the uploads not yet started ran on after the raise: let them show
    requests = list(proxy.requests)
    released = max(i for i, r in enumerate(requests) if r.method == "PUT" and r.path.endswith("/leases/finalizer.json"))
    late = [r.path for r in requests[released + 1 :] if r.method == "PUT" and f"/{STEP}/" in r.path]
    assert late == [], f"written after the finalizer lease was released: {late}"
    assert list_checkpoints(store, RUN) == [] and latest_checkpoint(store, RUN) is None

    outcome = commit_checkpoint(staged, store, RUN)  # the server answers again: the retry completes the commit
    assert outcome.num_files_skipped + outcome.num_files_uploaded == 4
    _assert_published_bitwise(store, staged, tmp_path / "copy")


def test_a_put_applied_then_answered_503_is_sent_again_and_the_commit_completes(proxy, s3_bucket_url, tmp_path):
    store = open_store(s3_bucket_url)
    staged = _staged(tmp_path)
    proxy.answer_error(_put_of("model-00001.safetensors"), status=503, code="SlowDown", times=1)
    outcome = commit_checkpoint(staged, store, RUN)
    assert [action for action, _ in proxy.applied] == ["error"]
    assert sum(_put_of("model-00001.safetensors")(r) for r in proxy.requests) == 2  # the client's own retry
    assert outcome.num_files_uploaded == 4
    _assert_published_bitwise(store, staged, tmp_path / "copy")


def test_a_part_answered_500_on_every_attempt_aborts_its_multipart_upload_and_the_retry_completes(
    proxy, s3_bucket_url, tmp_path
):
    from infra.store.s3_uploads import MULTIPART_THRESHOLD_BYTES, PART_SIZE_BYTES

    store = open_store(s3_bucket_url)
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "model-00000.safetensors").write_bytes(os.urandom(MULTIPART_THRESHOLD_BYTES + PART_SIZE_BYTES // 2))
    write_manifest(staged, {"run_id": RUN, "step": 8})
    attempts = store.timeouts.max_attempts
    second_part = lambda request: request.method == "PUT" and "partNumber=2&" in request.path + "&"  # noqa: E731
    proxy.answer_error(second_part, status=500, code="InternalError", times=attempts)
    with pytest.raises(ConnectionError, match="answered HTTP 500 on every attempt"):
        commit_checkpoint(staged, store, RUN)
    requests = list(proxy.requests)
    aborts = [i for i, r in enumerate(requests) if r.method == "DELETE" and "uploadId=" in r.path]
    assert aborts, "the multipart upload was not aborted"
    assert not [r for r in requests[aborts[-1] + 1 :] if "partNumber=" in r.path]  # no part after the abort
    bucket, _, prefix = s3_bucket_url.removeprefix("s3://").partition("/")
    dangling = store.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
    assert dangling.get("Uploads", []) == []
    assert list_checkpoints(store, RUN) == [] and latest_checkpoint(store, RUN) is None

    commit_checkpoint(staged, store, RUN)
    _assert_published_bitwise(store, staged, tmp_path / "copy")


def test_an_upload_being_recorded_when_a_sibling_fails_is_recorded_before_the_error_goes_up(
    proxy, s3_bucket_url, tmp_path
):
    """Before: the batch's cancel left the recording thread running, writing the journal after the raise."""
    store, staged, attempts = _first_upload_fails_every_attempt(proxy, s3_bucket_url, tmp_path)
    recorded: list[float] = []

    def slow_record(event: str) -> None:
        if event == "uploaded model-00001.safetensors":
            deadline = time.monotonic() + 300
            while len(proxy.applied) < attempts and time.monotonic() < deadline:  # the sibling fails meanwhile
                time.sleep(0.05)
            time.sleep(2.0)  # the client gives up after the last 500 in milliseconds: the raise would come first
            recorded.append(time.monotonic())

    with pytest.raises(ConnectionError, match="answered HTTP 500"):
        commit_checkpoint(staged, store, RUN, settings=PublishSettings(concurrency=2), observer=slow_record)
    raised = time.monotonic()
    assert len(proxy.applied) == attempts
    assert recorded and recorded[0] < raised


def test_an_upload_being_recorded_when_the_deadline_passes_is_recorded_before_the_timeout_goes_up(
    proxy, s3_bucket_url, tmp_path
):
    """Before: fsspec's sync() raised at its timeout while the cancelled batch still wrote (the record, an abort)."""
    store = open_store(s3_bucket_url)
    staged = _staged(tmp_path)
    recorded: list[float] = []

    def slow_first_record(event: str) -> None:
        if event.startswith("uploaded ") and not recorded:
            recorded.append(0.0)
            time.sleep(4.0)  # past the 2 s deadline
            recorded[0] = time.monotonic()

    with pytest.raises(StorageTimeoutError, match="did not finish within 2 s"):
        commit_checkpoint(
            staged, store, RUN, settings=PublishSettings(concurrency=2, timeout_s=2.0), observer=slow_first_record
        )
    raised = time.monotonic()
    assert recorded and 0.0 < recorded[0] < raised
    assert latest_checkpoint(store, RUN) is None

    commit_checkpoint(staged, store, RUN)  # the retry verifies what landed and completes
    _assert_published_bitwise(store, staged, tmp_path / "copy")
