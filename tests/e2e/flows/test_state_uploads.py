"""The run's state uploads as Prefect task runs: beside the flow, one in flight at a time, a failure stops the run.

The upload task is replaced by one that records when it ran (no torchrun, no store): what is tested is the
flow-side contract of `tasks.state_upload.StateUploads`, under the real Prefect harness and task runner.
The whole pipeline's uploads are checked in tests/e2e/flows/test_pipeline.py (its run graph and ledger).
"""

from __future__ import annotations

import threading
import time

import pytest
from prefect import flow, task

from tasks import state_upload
from tasks.outcomes import PlannedRun
from trainer_core.config import StorageSection

pytestmark = [pytest.mark.flow]


@pytest.fixture
def planned(tmp_path) -> PlannedRun:
    return PlannedRun(
        run_id="run-1",
        digest="d" * 64,
        run_dir=str(tmp_path / "run"),
        segment_steps=[(0, 1), (1, 2), (2, 3)],
        storage=StorageSection(url=str(tmp_path / "store")),
    )


@pytest.fixture
def uploads_seen(monkeypatch):
    """Replace the upload task: segment 0's waits until the flow has gone on (up to 300 s); a segment in `failing`
    fails; each records its times."""
    seen: dict = {"ran": [], "failing": set(), "flow_went_on": threading.Event()}

    @task(name="state-upload", retries=0)
    def fake_upload(planned: PlannedRun, segment_index: int) -> dict:
        started = time.monotonic()
        if segment_index in seen["failing"]:
            raise ConnectionError(f"injected failure of upload {segment_index}")
        if segment_index == 0:
            seen["overlapped"] = seen["flow_went_on"].wait(timeout=300)  # set at once unless it waits behind
            time.sleep(0.5)  # long enough for upload 1 to start beside it, if nothing held it back
        seen["ran"].append((segment_index, started, time.monotonic()))
        return {"segment": segment_index}

    monkeypatch.setattr(state_upload, "upload_state", fake_upload)
    return seen


@flow
def segments_with_uploads(planned: PlannedRun, num_segments: int, flow_went_on: threading.Event) -> float:
    uploads = state_upload.StateUploads(planned)
    for index in range(num_segments):
        uploads.after(index)
        flow_went_on.set()  # where the next segment starts: not behind the upload just submitted
    uploads.wait()
    return uploads.waited_s


def test_uploads_run_beside_the_flow_one_at_a_time(prefect_harness, planned, uploads_seen):
    waited_s = segments_with_uploads(planned, 3, uploads_seen["flow_went_on"])
    ran = {segment: (start, end) for segment, start, end in uploads_seen["ran"]}
    assert sorted(ran) == [0, 1, 2]
    assert uploads_seen["overlapped"]  # upload 0 was still running when the flow went on
    assert ran[0][1] <= ran[1][0] and ran[1][1] <= ran[2][0]  # one in flight: each waits for the one before
    assert waited_s >= 0


def test_a_failed_upload_fails_the_run_and_nothing_after_it_is_uploaded(prefect_harness, planned, uploads_seen):
    uploads_seen["failing"].add(0)
    with pytest.raises(ConnectionError, match="injected failure of upload 0"):
        segments_with_uploads(planned, 2, uploads_seen["flow_went_on"])
    assert uploads_seen["ran"] == []  # upload 1 never ran past a failed upload 0
