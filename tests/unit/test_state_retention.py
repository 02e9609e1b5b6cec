"""Retention of segment states (storage.keep_states) on a local, an in-memory and (marked s3) a SeaweedFS store.

A run of four segments, exporting after segments 1 and 3: once step 12's
checkpoint (segment 3) commits, the states of segments 0-2 are needed by
nothing — each is checked gone from the store and the work dir, its result
still in a bundle that verifies (a rerun reuses the segment, never retrains
it) — and segment 3's stays. A state whose export has not committed stays; a
gc killed after it hid a state leaves no listed state and the next finishes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import infra.runs.state_retention as state_retention_module
from infra.publication.commit import commit_checkpoint
from infra.publication.finalizer import FinalizerSettings
from infra.publication.retention import RetentionPolicy, SegmentStates, apply_retention
from infra.runs.run_state import fetch_bundle, publish_bundle, read_bundle_manifest, segment_bundle, stored_bundle
from infra.store import open_store
from infra.store.objects import list_files
from tests.publication_helpers import RUN, random_files, stage
from tests.store_fixtures import memory_or_local_store
from trainer_core.run.state_record import record_path, write_record

NUM_SEGMENTS, STEPS_PER_SEGMENT = 4, 3
QUICK = FinalizerSettings(wait_s=5.0, poll_s=0.05)


store = memory_or_local_store  # the fixture, under the name these tests use


def state_files(segment: int) -> dict[str, bytes]:
    return {
        f"state/segment-{segment:04d}/base/params.safetensors": os.urandom(4000 + segment),
        f"state/segment-{segment:04d}/meta.json": b'{"segment": %d}' % segment,
        f"segments/segment-{segment:04d}.json": b'{"losses": [%d]}' % segment,
    }


def stored_run(store, run_dir: Path) -> dict[int, dict[str, bytes]]:
    """Every segment's bundle stored, as segments do; the files of each."""
    files = {}
    for segment in range(NUM_SEGMENTS):
        files[segment] = state_files(segment)
        for relative, data in files[segment].items():
            (run_dir / relative).parent.mkdir(parents=True, exist_ok=True)
            (run_dir / relative).write_bytes(data)
        write_record(run_dir / f"state/segment-{segment:04d}")  # as a save leaves it
        publish_bundle(store, RUN, run_dir, segment_bundle(segment), files[segment])
    return files


def exported(segment: int) -> bool:
    return segment in (1, 3)


def commit_step_of(store, tmp_path: Path, segment: int) -> None:
    step = (segment + 1) * STEPS_PER_SEGMENT
    commit_checkpoint(stage(tmp_path / f"export-{segment}", step, random_files(1, 500)), store, RUN)


def states(run_dir: Path, anchor: int) -> SegmentStates:
    return SegmentStates(
        anchor=anchor,
        exported=exported,
        end_step=lambda j: (j + 1) * STEPS_PER_SEGMENT,
        state_prefix=lambda j: f"state/segment-{j:04d}",
        run_dir=run_dir,
    )


def state_in_store(store, segment: int) -> dict[str, int]:
    return list_files(store, store.path(RUN, f"state/segment-{segment:04d}"))


@pytest.mark.s3
def test_on_seaweedfs_too(s3_env, s3_bucket_url, tmp_path):
    test_states_before_the_committed_checkpoint_go_and_results_stay(open_store(s3_bucket_url), tmp_path)


def test_states_before_the_committed_checkpoint_go_and_results_stay(store, tmp_path):
    run_dir = tmp_path / "work"
    files = stored_run(store, run_dir)
    commit_step_of(store, tmp_path, 1)
    commit_step_of(store, tmp_path, 3)
    report = apply_retention(store, RUN, RetentionPolicy(keep_states=False), QUICK, states(run_dir, anchor=3))
    assert report.states_removed == [0, 1, 2]
    assert report.state_bytes_removed == sum(
        len(data) for j in (0, 1, 2) for path, data in files[j].items() if path.startswith("state/")
    )
    for segment in (0, 1, 2):
        assert state_in_store(store, segment) == {} and not (run_dir / f"state/segment-{segment:04d}").exists()
        assert not record_path(run_dir / f"state/segment-{segment:04d}").exists()  # the record went with it
        manifest = stored_bundle(store, RUN, segment_bundle(segment))  # verifies: the rerun reuses the segment
        assert manifest is not None and [e.path for e in manifest.files] == [f"segments/segment-{segment:04d}.json"]
    assert record_path(run_dir / "state/segment-0003").exists()
    assert set(state_in_store(store, 3)) == {"base/params.safetensors", "meta.json"}
    fresh = tmp_path / "fresh"  # another worker resumes from segment 3's state, verified
    fetch_bundle(store, RUN, fresh, segment_bundle(3))
    assert {p: (fresh / p).read_bytes() for p in files[3]} == files[3]


def test_keep_states_keeps_every_state(store, tmp_path):
    run_dir = tmp_path / "work"
    stored_run(store, run_dir)
    commit_step_of(store, tmp_path, 1)
    report = apply_retention(store, RUN, RetentionPolicy(keep_states=True), QUICK, states(run_dir, anchor=1))
    assert report.states_removed == []
    assert all(state_in_store(store, j) and (run_dir / f"state/segment-{j:04d}").is_dir() for j in range(4))


def test_a_state_whose_export_has_not_committed_stays(store, tmp_path):
    """Segment 1's export failed (a retry is pending); segment 3's committed: segment 1's state is still needed."""
    run_dir = tmp_path / "work"
    stored_run(store, run_dir)
    commit_step_of(store, tmp_path, 3)
    report = apply_retention(store, RUN, RetentionPolicy(keep_states=False), QUICK, states(run_dir, anchor=3))
    assert report.states_removed == [0, 2]
    assert state_in_store(store, 1) and stored_bundle(store, RUN, segment_bundle(1)) is not None
    manifest = read_bundle_manifest(store, RUN, segment_bundle(1))
    assert manifest is not None and len(manifest.files) == 3


def test_no_state_goes_while_the_anchors_bundle_is_incomplete(store, tmp_path):
    run_dir = tmp_path / "work"
    stored_run(store, run_dir)
    commit_step_of(store, tmp_path, 1)
    store.remove([store.key(RUN, "run-state", "segment-0001.json")])  # its upload never finished
    report = apply_retention(store, RUN, RetentionPolicy(keep_states=False), QUICK, states(run_dir, anchor=1))
    assert report.states_removed == [] and state_in_store(store, 0)


def test_a_gc_killed_after_hiding_a_state_is_finished_by_the_next(store, tmp_path, monkeypatch):
    run_dir = tmp_path / "work"
    stored_run(store, run_dir)
    commit_step_of(store, tmp_path, 1)
    real_remove = state_retention_module.remove_files
    monkeypatch.setattr(state_retention_module, "remove_files", lambda *a, **k: (_ for _ in ()).throw(OSError("cut")))
    with pytest.raises(OSError, match="cut"):
        apply_retention(store, RUN, RetentionPolicy(keep_states=False), QUICK, states(run_dir, anchor=1))
    manifest = read_bundle_manifest(store, RUN, segment_bundle(0))
    assert manifest is not None and [e.path for e in manifest.files] == ["segments/segment-0000.json"]
    assert state_in_store(store, 0)  # objects left, listed by no manifest
    monkeypatch.setattr(state_retention_module, "remove_files", real_remove)
    report = apply_retention(store, RUN, RetentionPolicy(keep_states=False), QUICK, states(run_dir, anchor=1))
    assert report.states_removed == [0] and state_in_store(store, 0) == {}
