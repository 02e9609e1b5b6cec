"""A real storage outage mid-commit: nothing half-visible, and a retry after the restart completes it."""

from __future__ import annotations

import pytest

from infra.publication.checkpoints import download_checkpoint, latest_checkpoint, list_checkpoints
from infra.publication.commit import PublishSettings, commit_checkpoint
from infra.services.s3_server import start_s3_server
from infra.store import open_store
from tests.storage.staging import stage_checkpoint

pytestmark = pytest.mark.s3

RUN = "outage-run"


def use_server(monkeypatch, server) -> None:
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    # Fail fast while the server is down instead of retrying for minutes.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")


def test_server_stopped_mid_commit_then_retried_after_restart(tmp_path, monkeypatch):
    staged = stage_checkpoint(tmp_path, RUN, 8)
    data_dir = tmp_path / "s3"
    server = start_s3_server(data_dir)
    try:
        server.create_bucket("outage")
        use_server(monkeypatch, server)
        store = open_store("s3://outage/runs")
        landed = []

        def stop_after_two_uploads(event: str) -> None:
            if event.startswith("uploaded "):
                landed.append(event.removeprefix("uploaded "))
                if len(landed) == 2:
                    server.stop(timeout_s=3)  # the storage goes away mid-commit

        # The upload after the second may already be on its way as weed stops: refused (unreachable),
        # cut short, or answered 500 InternalError by a server going down; each names the store.
        with pytest.raises(ConnectionError, match="object storage at s3://outage/runs (is unreachable|cut|answered)"):
            commit_checkpoint(
                staged, store, RUN, settings=PublishSettings(concurrency=1), observer=stop_after_two_uploads
            )
    finally:
        server.stop(timeout_s=3)
    with start_s3_server(data_dir) as restarted:  # same data, new port and credentials
        use_server(monkeypatch, restarted)
        store = open_store("s3://outage/runs")
        assert list_checkpoints(store, RUN) == [] and latest_checkpoint(store, RUN) is None
        outcome = commit_checkpoint(staged, store, RUN)
        # The files that landed before the outage are verified (size and sha256) and not uploaded again.
        assert set(landed) <= set(outcome.uploaded) ^ {f.name for f in staged.glob("*.safetensors")}
        assert outcome.num_files_skipped >= 2 and outcome.num_files_skipped + outcome.num_files_uploaded == 4
        assert latest_checkpoint(store, RUN) == "step-00000008"
        copy = download_checkpoint(store, RUN, "step-00000008", tmp_path / "copy")
        for file in staged.glob("*.safetensors"):
            assert (copy / file.name).read_bytes() == file.read_bytes()
