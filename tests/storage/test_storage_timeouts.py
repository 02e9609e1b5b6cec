"""A stopped (SIGSTOP) S3 server: commit, cleanup and the ledger upload fail in bounded time with a
clear, retriable error instead of hanging; after SIGCONT the retries finish.

Before the time limits, a stopped server blocked the commit indefinitely.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from infra.publication.checkpoints import verify_checkpoint
from infra.publication.cleanup import cleanup_staging
from infra.publication.commit import PublishSettings, commit_checkpoint
from infra.runs import ledger
from infra.services.s3_server import start_s3_server
from infra.store import open_store
from infra.store.base import StoreTimeouts
from tasks.outcomes import PlannedRun
from tasks.report import publish_run_files_fn
from tests.publication_helpers import RUN, random_files, stage
from trainer_core.config import StorageSection, TrainSection

pytestmark = pytest.mark.s3

TIGHT = StoreTimeouts(connect_s=2, read_s=2, max_attempts=2)
LIMIT_S = 120  # far above the expected failure time (~2 × 2 s per request, a 20 s deadline), far below "forever"


def bounded(action, limit_s: float = LIMIT_S):
    """Run `action` in a thread; the exception it raised and how long it took (fails the test past limit_s)."""
    outcome: dict = {}

    def run():
        started = time.monotonic()
        try:
            action()
        except Exception as error:  # noqa: BLE001 - returned to the test
            outcome["error"] = error
        outcome["elapsed_s"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"still blocked after {limit_s} s against a stopped server"
    return outcome.get("error"), outcome["elapsed_s"]


@pytest.fixture
def server(tmp_path, monkeypatch):
    with start_s3_server(tmp_path / "s3") as running:
        running.create_bucket("stopped")
        for name, value in running.env().items():
            monkeypatch.setenv(name, value)
        yield running
        os.killpg(running.pid, signal.SIGCONT)  # never leave it stopped for stop()


def test_commit_cleanup_and_report_fail_in_bounded_time_then_resume(server, tmp_path):
    store = open_store("s3://stopped/runs", TIGHT)
    settings = PublishSettings(timeout_s=20)
    first = stage(tmp_path, 10, random_files(2, 100_000))
    commit_checkpoint(first, store, RUN, settings=settings)
    second = stage(tmp_path, 20, random_files(3, 300_000))
    run_dir = tmp_path / "run"
    ledger.record(run_dir, "commit", "completed", step=10)
    planned = PlannedRun(
        run_id=RUN,
        digest="d",
        run_dir=str(run_dir),
        segment_steps=[(0, 20)],
        train=TrainSection(segment_timeout_s=60),
        storage=StorageSection(url="s3://stopped/runs", timeout_s=20, request_timeout_s=2),
    )

    os.killpg(server.pid, signal.SIGSTOP)
    try:
        error, _ = bounded(lambda: commit_checkpoint(second, store, RUN, settings=settings))
        assert isinstance(error, OSError) and "retry" in str(error), error  # ConnectionError or a TimeoutError
        assert server.endpoint_url.removeprefix("http://") in str(error) or "s3://stopped/runs" in str(error)
        error, _ = bounded(lambda: cleanup_staging(first, store, RUN, settings=settings))
        assert isinstance(error, OSError), error
        error, _ = bounded(lambda: publish_run_files_fn(planned))
        assert isinstance(error, OSError) and "retry" in str(error), error
    finally:
        os.killpg(server.pid, signal.SIGCONT)

    outcome = commit_checkpoint(second, store, RUN, settings=settings)
    assert outcome.latest_moved and verify_checkpoint(store, RUN, "step-00000020", full=True).verified
    assert cleanup_staging(first, store, RUN, settings=settings).state == "CLEANED"
    assert publish_run_files_fn(planned)["ledger.jsonl"].endswith(f"{RUN}/ledger.jsonl")
