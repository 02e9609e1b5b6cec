"""The export, commit and cleanup stages on a trained run (task functions, real torchrun launches).

- a rank failing export preparation: every rank aborts, the publication is
  ABORTED with the rank named, nothing is staged or visible; the retry
  publishes;
- a staged file spoiled after the export (same size, other bytes): the commit
  stage notices, exports the step again and publishes the right bytes;
- a re-run of a published step exports nothing and uploads nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.launch.launcher import LaunchError
from infra.publication.checkpoints import list_checkpoints, verify_checkpoint
from infra.publication.journal import journal_path_for
from infra.publication.latest import read_latest
from infra.store import open_store
from tasks.export import export_segment_fn
from tasks.plan import plan_run_fn
from tasks.publish import cleanup_fn, commit_fn
from tests.conftest import tiny_tree
from tests.publication_helpers import same_size_other_bytes
from tests.state_helpers import train_and_store
from trainer_core.config import config_from_dict
from trainer_core.run.faults import EXPORT_FAULT_ENV

pytestmark = [pytest.mark.distributed]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("publication-stages")
    config = config_from_dict(tiny_tree(tmp_path, train={"steps": 3, "steps_per_segment": 3}), config_dir=tmp_path)
    planned = plan_run_fn(config)
    train_and_store(planned, 0)
    return planned


def journal_of(planned) -> dict:
    staged = Path(planned.run_dir) / "export" / "step-00000003"
    return json.loads(journal_path_for(staged, open_store(planned.storage)).read_text())


def test_a_rank_failing_export_preparation_aborts_the_publication(trained, tmp_path, monkeypatch):
    monkeypatch.setenv(EXPORT_FAULT_ENV, f"1:{tmp_path / 'fault-marker'}")
    with pytest.raises(LaunchError, match="failed on rank 1 .*InjectedFault"):
        export_segment_fn(trained, 0)
    journal = journal_of(trained)
    assert journal["state"] == "ABORTED" and "rank 1" in journal["error"]
    export_dir = Path(trained.run_dir) / "export"
    assert sorted(p.name for p in export_dir.iterdir()) == ["journals"]  # the journals, one directory per store
    store = open_store(trained.storage)
    assert list_checkpoints(store, trained.run_id) == [] and read_latest(store, trained.run_id) is None
    mirror = json.loads(Path(store.path(trained.run_id, "publications", "step-00000003.json")).read_text())
    assert mirror["state"] == "ABORTED"

    exported = export_segment_fn(trained, 0)  # the retry: a new publication
    assert journal_of(trained)["state"] == "PREPARED"
    assert journal_of(trained)["publication_id"] != journal["publication_id"]
    committed = commit_fn(trained, exported)
    assert committed.latest_moved and cleanup_fn(trained, exported).state == "CLEANED"
    assert verify_checkpoint(store, trained.run_id, "step-00000003", full=True).verified


def test_a_spoiled_staging_is_exported_again_not_uploaded(trained, tmp_path):
    store = open_store(trained.storage)
    # A fresh publication of the step: forget what an earlier test published
    # (not the run's state in the store, which the export resumes from).
    journal_path_for(Path(trained.run_dir) / "export" / "step-00000003", store).unlink(missing_ok=True)
    for published in ("checkpoints", "publications", "LATEST"):
        if store.fs.exists(store.path(trained.run_id, published)):
            store.fs.rm(store.path(trained.run_id, published), recursive=True)
    exported = export_segment_fn(trained, 0)
    weights = Path(exported.staged_dir) / "model.safetensors"
    original = weights.read_bytes()
    same_size_other_bytes(weights)
    committed = commit_fn(trained, exported)
    assert committed.latest_moved
    remote = Path(store.path(trained.run_id, "checkpoints", "step-00000003", "model.safetensors"))
    assert remote.read_bytes() == original  # the export was redone; the spoiled bytes never left
    history = [h["state"] for h in journal_of(trained)["history"]]
    assert history[-6:] == ["COMMITTING", "PREPARING", "PREPARING", "PREPARED", "COMMITTING", "COMMITTED"]


def test_a_rerun_of_a_published_step_exports_and_uploads_nothing(trained):
    exported = export_segment_fn(trained, 0)
    if not exported.reused:
        commit_fn(trained, exported)
        cleanup_fn(trained, exported)
        exported = export_segment_fn(trained, 0)
    assert exported.reused and exported.launch_wall_s == 0
    again = commit_fn(trained, exported)
    assert again.already_committed and again.bytes_uploaded == 0
    assert cleanup_fn(trained, exported).state == "CLEANED"
