"""The publication protocol on a local store and a MemoryStore: journal transitions, verified retries, hostile
manifests and LATEST, stale shards, cleanup failures, garbage collection.

Tests marked "defect:" reproduce a failure of the protocol before the journal
(size-only retries, path traversal, LATEST trusted as written, one corrupt
manifest breaking the listing, stale shards kept): each fails on that code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from infra.publication.checkpoints import (
    download_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    resolve_latest,
    scan_checkpoints,
    verify_checkpoint,
)
from infra.publication.cleanup import abort_publication, cleanup_staging
from infra.publication.commit import PublishSettings, StagedFileChanged, commit_checkpoint, read_latest
from infra.publication.journal import Journal, PublicationState, TransitionError, journal_path_for
from infra.publication.manifests import ManifestError
from infra.publication.orphans import collect_garbage
from infra.store import MemoryStore, open_store
from infra.store.lease import Lease, LeaseHeldError
from tests.publication_helpers import (
    RUN,
    fail_after_uploads,
    random_files,
    rewrite_manifest,
    same_size_other_bytes,
    stage,
)
from trainer_core.run.manifest import write_manifest

FILES = {
    "config.json": b"{}",
    "model-00001-of-00002.safetensors": b"a" * 1000,
    "model-00002-of-00002.safetensors": b"b" * 500,
}
FAST = PublishSettings(concurrency=1)


def crash_after_uploads(num_uploads: int):
    # Not an Exception: nothing in the commit may catch a crash.
    return fail_after_uploads(num_uploads, KeyboardInterrupt("simulated crash"))


def state_of(staged: Path, store) -> str:
    return json.loads(journal_path_for(staged, store).read_text())["state"]


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path):
    """The protocol needs nothing but the ObjectStore methods, so it runs on both (tests that touch files: local)."""
    if request.param == "local":
        yield open_store(str(tmp_path / "store"))
        return
    with MemoryStore() as memory:
        yield memory


LOCAL_ONLY = pytest.mark.parametrize("store", ["local"], indirect=True)


# -- the state machine ------------------------------------------------------------


def test_journal_records_every_transition_durably_and_mirrors_it(tmp_path, store):
    staged = stage(tmp_path, 10, FILES)
    commit_checkpoint(staged, store, RUN)
    cleanup_staging(staged, store, RUN)
    local = json.loads(journal_path_for(staged, store).read_text())
    assert [h["state"] for h in local["history"]] == ["PREPARED", "COMMITTING", "COMMITTED", "CLEANED"]
    mirror = json.loads(store.get(store.key(RUN, "publications", "step-00000010.json")).data)
    assert mirror["state"] == "CLEANED" and mirror["publication_id"] == local["publication_id"]
    assert set(local["uploaded"]) == set(FILES)


def test_finishing_after_an_abort_and_aborting_after_a_commit_are_refused(tmp_path, store):
    staged = stage(tmp_path, 10, FILES)
    journal = Journal.for_staging(staged, store, RUN, 10)
    journal.begin("fp")
    abort_publication(staged, store, RUN, 10, reason="rank 1 failed")
    with pytest.raises(TransitionError, match="ABORTED .*rank 1 failed.*export the step again"):
        commit_checkpoint(staged, store, RUN)
    assert list_checkpoints(store, RUN) == []

    other = stage(tmp_path, 20, FILES)
    commit_checkpoint(other, store, RUN)
    with pytest.raises(TransitionError, match="COMMITTED; it cannot be aborted"):
        abort_publication(other, store, RUN, 20, reason="too late")
    cleanup_staging(other, store, RUN)
    with pytest.raises(TransitionError, match="CLEANED, a final state"):
        Journal.for_staging(other, store, RUN, 20).transition(PublicationState.COMMITTING)
    assert list_checkpoints(store, RUN) == ["step-00000020"]


def test_a_second_finalizer_is_refused_naming_the_holder(tmp_path, store):
    staged = stage(tmp_path, 10, FILES)
    holder = Lease.for_run(store, RUN, "finalizer", owner="node-7:4242", ttl_s=60)
    holder.acquire()
    quick = PublishSettings(finalizer=type(FAST.finalizer)(wait_s=0.3, poll_s=0.1))
    with pytest.raises(LeaseHeldError, match="held by node-7:4242 .*expires in"):
        commit_checkpoint(staged, store, RUN, settings=quick)
    assert state_of(staged, store) == "PREPARED" and list_checkpoints(store, RUN) == []
    holder.release()
    assert commit_checkpoint(staged, store, RUN, settings=quick).latest_moved


def test_a_retry_with_an_outcome_reruns_only_cleanup(tmp_path, store):
    staged = stage(tmp_path, 10, FILES)
    first = commit_checkpoint(staged, store, RUN)
    again = commit_checkpoint(staged, store, RUN)
    assert again.already_committed and again.bytes_uploaded == 0 and again.num_files_uploaded == 0
    assert first.bytes_uploaded == sum(map(len, FILES.values()))
    cleanup_staging(staged, store, RUN)
    assert commit_checkpoint(staged, store, RUN).already_committed  # even with the staging gone
    assert cleanup_staging(staged, store, RUN).state == "CLEANED"


def test_cleanup_refuses_a_publication_that_is_not_committed(tmp_path, store):
    staged = stage(tmp_path, 10, FILES)
    Journal.for_staging(staged, store, RUN, 10).begin("fp")
    Journal.for_staging(staged, store, RUN, 10).transition(PublicationState.PREPARED)
    with pytest.raises(TransitionError, match="not committed"):
        cleanup_staging(staged, store, RUN)
    assert (staged / "MANIFEST.json").is_file()


# -- verified retries -----------------------------------------------------------------


def test_defect_retry_after_reexport_with_same_sizes_reuploads_what_changed(tmp_path, store):
    """Before: a retry skipped objects by size alone and published a manifest over stale bytes."""
    files = random_files(3, 4000)
    staged = stage(tmp_path, 10, files)
    with pytest.raises(KeyboardInterrupt):
        commit_checkpoint(staged, store, RUN, settings=FAST, observer=crash_after_uploads(2))
    # The export is redone with other bytes of the same sizes (e.g. a re-run after a crash).
    for path in staged.glob("*.safetensors"):
        same_size_other_bytes(path)
    write_manifest(staged, {"run_id": RUN, "step": 10})  # the re-export's manifest: same sizes, other digests
    retried = commit_checkpoint(staged, store, RUN)
    assert retried.num_files_uploaded == 3  # every changed object, although its size matched
    report = verify_checkpoint(store, RUN, "step-00000010", full=True)
    assert report.verified, report.problems


def test_a_staged_file_corrupted_after_export_is_not_uploaded(tmp_path, store):
    staged = stage(tmp_path, 10, random_files(2, 3000))
    victim = sorted(staged.glob("*.safetensors"))[0]
    same_size_other_bytes(victim)
    with pytest.raises(StagedFileChanged, match="no longer matches its manifest"):
        commit_checkpoint(staged, store, RUN)
    assert state_of(staged, store) == "PREPARING"  # back to the export, which must serialize it again
    assert list_checkpoints(store, RUN) == [] and read_latest(store, RUN) is None
    assert store.head([store.key(RUN, "checkpoints", "step-00000010", victim.name)]) == {}


def test_a_corruption_of_an_uploaded_file_does_not_reach_the_store(tmp_path, store):
    staged = stage(tmp_path, 10, random_files(2, 3000))
    with pytest.raises(KeyboardInterrupt):
        commit_checkpoint(staged, store, RUN, settings=FAST, observer=crash_after_uploads(1))
    uploaded = store.children(store.key(RUN, "checkpoints", "step-00000010"))
    same_size_other_bytes(staged / uploaded[0])  # the staging spoils after its upload
    retried = commit_checkpoint(staged, store, RUN)
    assert retried.uploaded == tuple(sorted({p.name for p in staged.glob("*.safetensors")} - set(uploaded)))
    assert verify_checkpoint(store, RUN, "step-00000010", full=True).verified


# -- hostile manifests --------------------------------------------------------------


@LOCAL_ONLY
@pytest.mark.parametrize("path", ["../../escaped.bin", "/etc/hostname", "a/../../b", "./x", "a//b"])
def test_defect_a_staged_manifest_cannot_upload_or_write_outside(tmp_path, store, path):
    staged = stage(tmp_path, 10, FILES)
    (tmp_path / "escaped.bin").write_bytes(b"host file")
    rewrite_manifest(staged, lambda m: m["files"].append({"path": path, "size": 9, "sha256": "0" * 64}))
    with pytest.raises(ManifestError, match="refusing"):
        commit_checkpoint(staged, store, RUN)
    assert not any(p.name == "escaped.bin" for p in Path(store.root).rglob("*"))
    assert list_checkpoints(store, RUN) == []


def test_a_staged_symlink_to_a_host_file_is_refused(tmp_path, store):
    staged = stage(tmp_path, 10, FILES)
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"x" * 500)
    (staged / "model-00002-of-00002.safetensors").unlink()
    (staged / "model-00002-of-00002.safetensors").symlink_to(secret)
    with pytest.raises(ManifestError, match="link or leaves the staging"):
        commit_checkpoint(staged, store, RUN)


def test_defect_a_stored_manifest_with_escaping_paths_is_refused_by_readers(tmp_path, store):
    commit_checkpoint(stage(tmp_path, 10, FILES), store, RUN)
    commit_checkpoint(stage(tmp_path, 20, FILES), store, RUN)
    manifest_key = store.key(RUN, "checkpoints", "step-00000020", "MANIFEST.json")
    manifest = json.loads(store.get(manifest_key).data)
    manifest["files"][0]["path"] = "../../../../outside.txt"
    store.put(manifest_key, json.dumps(manifest).encode())
    with pytest.raises(ManifestError, match="leaves its checkpoint"):
        download_checkpoint(store, RUN, "step-00000020", tmp_path / "dl" / "inner")
    assert not (tmp_path / "outside.txt").exists() and not (tmp_path / "dl" / "inner").exists()
    # LATEST names step 20; readers report it and fall back to step 10.
    resolution = resolve_latest(store, RUN)
    assert resolution.checkpoint == "step-00000010" and resolution.fell_back
    assert "step-00000020" in resolution.message and "leaves its checkpoint" in resolution.message


def test_a_manifest_of_another_run_or_step_is_refused(tmp_path, store):
    commit_checkpoint(stage(tmp_path, 10, FILES), store, RUN)
    key = store.key(RUN, "checkpoints", "step-00000010", "MANIFEST.json")
    manifest = json.loads(store.get(key).data)
    store.put(key, json.dumps({**manifest, "run_id": "someone-else"}).encode())
    assert "run 'someone-else'" in verify_checkpoint(store, RUN, "step-00000010").problems[0]
    store.put(key, json.dumps({**manifest, "step": 11}).encode())
    assert "stored as step 10" in verify_checkpoint(store, RUN, "step-00000010").problems[0]


# -- hostile or broken LATEST and manifests ---------------------------------------------


@pytest.mark.parametrize(
    "latest",
    [
        b'{"checkpoint": "step-x", "step": "ten"}',
        b"not json",
        b'{"checkpoint": "step-999999999999", "step": 999999999999}',
        b"{}",
    ],
)
def test_defect_a_corrupt_or_far_future_latest_never_blocks_commits(tmp_path, store, latest):
    commit_checkpoint(stage(tmp_path, 10, FILES), store, RUN)
    store.put(store.key(RUN, "LATEST"), latest)
    outcome = commit_checkpoint(stage(tmp_path, 20, FILES), store, RUN)
    assert outcome.latest_moved and read_latest(store, RUN) == {"checkpoint": "step-00000020", "step": 20}
    assert any("LATEST was not trustworthy" in note for note in outcome.notes)
    outcome = commit_checkpoint(stage(tmp_path, 30, FILES), store, RUN)
    assert outcome.latest_moved and read_latest(store, RUN)["step"] == 30  # not frozen


def test_repairing_latest_never_moves_it_behind_the_newest_checkpoint(tmp_path, store):
    commit_checkpoint(stage(tmp_path, 30, FILES), store, RUN)
    store.put(store.key(RUN, "LATEST"), b"garbage")
    outcome = commit_checkpoint(stage(tmp_path, 10, FILES), store, RUN)
    assert read_latest(store, RUN)["step"] == 30 and outcome.latest_step == 30


def test_defect_one_corrupt_manifest_does_not_break_listing(tmp_path, store):
    for step in (10, 20, 30):
        commit_checkpoint(stage(tmp_path, step, FILES), store, RUN)
    store.put(store.key(RUN, "checkpoints", "step-00000030", "MANIFEST.json"), b"{ truncated")
    assert list_checkpoints(store, RUN) == ["step-00000010", "step-00000020"]
    reports = {r.name: r for r in scan_checkpoints(store, RUN)}
    assert not reports["step-00000030"].verified and "not valid JSON" in reports["step-00000030"].problems[0]
    resolution = resolve_latest(store, RUN)
    assert resolution.checkpoint == "step-00000020" and "falling back" in resolution.message
    assert latest_checkpoint(store, RUN) == "step-00000020"
    # Committing goes on: LATEST pointing at the broken checkpoint is replaced by a newer step.
    assert commit_checkpoint(stage(tmp_path, 40, FILES), store, RUN).latest_moved


def test_latest_pointing_at_a_missing_checkpoint_falls_back_and_says_so(tmp_path, store):
    commit_checkpoint(stage(tmp_path, 10, FILES), store, RUN)
    store.put(store.key(RUN, "LATEST"), json.dumps({"checkpoint": "step-00000050", "step": 50}).encode())
    resolution = resolve_latest(store, RUN)
    assert resolution.checkpoint == "step-00000010" and resolution.pointer == "step-00000050"
    assert "step-00000050, which does not verify" in resolution.message


@LOCAL_ONLY
def test_format_1_manifests_stay_readable(tmp_path, store):
    staged = stage(tmp_path, 10, FILES)
    rewrite_manifest(
        staged,
        lambda m: (
            m.update(format="rankflow-checkpoint/1"),
            [m.pop(k) for k in ("plan_digest", "parent_checkpoint", "world_size")],
        ),
    )
    commit_checkpoint(staged, store, RUN)
    report = verify_checkpoint(store, RUN, "step-00000010", full=True)
    assert report.verified and report.manifest.format == "rankflow-checkpoint/1"
    rewrite_manifest(
        Path(store.path(RUN, "checkpoints", "step-00000010")), lambda m: m.update(format="rankflow-checkpoint/9")
    )
    assert "unknown format" in verify_checkpoint(store, RUN, "step-00000010").problems[0]


# -- order of commits ------------------------------------------------------------------


def test_an_older_step_committed_after_a_newer_one_never_moves_latest_back(tmp_path, store):
    commit_checkpoint(stage(tmp_path, 20, FILES), store, RUN)
    older = commit_checkpoint(stage(tmp_path, 10, FILES), store, RUN)
    assert not older.latest_moved and read_latest(store, RUN)["step"] == 20
    assert list_checkpoints(store, RUN) == ["step-00000010", "step-00000020"]


# -- stale shards, cleanup failures, garbage -------------------------------------------


def test_defect_recommitting_a_step_with_another_layout_removes_the_old_shards(tmp_path, store):
    commit_checkpoint(stage(tmp_path, 10, random_files(4, 2000)), store, RUN)
    relayout = stage(tmp_path / "again", 10, random_files(2, 4000))
    outcome = commit_checkpoint(relayout, store, RUN)
    remote = set(store.children(store.key(RUN, "checkpoints", "step-00000010")))
    assert remote == {p.name for p in relayout.iterdir()} and outcome.stale_objects_removed == 4
    assert any("replaced an earlier commit" in note for note in outcome.notes)
    assert verify_checkpoint(store, RUN, "step-00000010", full=True).verified


def test_a_failed_cleanup_leaves_the_commit_and_its_retry_finishes(tmp_path, store):
    staged = stage(tmp_path, 10, FILES)
    commit_checkpoint(staged, store, RUN)

    def fail_in_the_store(event: str) -> None:
        if event == "cleanup-lease":
            raise ConnectionError("injected: the store went away during cleanup")

    with pytest.raises(ConnectionError):
        cleanup_staging(staged, store, RUN, observer=fail_in_the_store)
    assert state_of(staged, store) == "COMMITTED"
    assert list_checkpoints(store, RUN) == ["step-00000010"] and read_latest(store, RUN)["step"] == 10
    assert verify_checkpoint(store, RUN, "step-00000010", full=True).verified
    retried = cleanup_staging(staged, store, RUN)
    assert retried.state == "CLEANED" and state_of(staged, store) == "CLEANED" and not staged.exists()


@LOCAL_ONLY
def test_gc_removes_orphans_and_never_a_committed_checkpoint_or_another_run(tmp_path, store):
    committed = stage(tmp_path, 10, FILES)
    commit_checkpoint(committed, store, RUN)
    with pytest.raises(KeyboardInterrupt):  # a commit that died: objects without a manifest
        commit_checkpoint(
            stage(tmp_path, 20, random_files(3, 1000)), store, RUN, settings=FAST, observer=crash_after_uploads(2)
        )
    base = Path(store.path(RUN))
    (base / "checkpoints" / "step-00000010" / "old-shard.safetensors").write_bytes(b"z" * 77)
    (base / "checkpoints" / "step-00000020" / ".x.rankflow-tmp-1-ab").write_bytes(b"t")
    neighbour = Path(store.path(RUN + "X", "checkpoints", "step-00000020"))  # a run whose id extends ours
    neighbour.mkdir(parents=True)
    (neighbour / "data.bin").write_bytes(b"n")
    dry = collect_garbage(store, RUN, dry_run=True)
    assert len(dry.removed) >= 3 and (base / "checkpoints" / "step-00000010" / "old-shard.safetensors").exists()
    report = collect_garbage(store, RUN)
    assert report.removed_bytes >= 2077
    assert not any((base / "checkpoints" / "step-00000020").glob("*"))
    assert not (base / "checkpoints" / "step-00000010" / "old-shard.safetensors").exists()
    assert (neighbour / "data.bin").read_bytes() == b"n"
    assert verify_checkpoint(store, RUN, "step-00000010", full=True).verified
    assert collect_garbage(store, RUN).removed == []


def test_gc_keeps_a_checkpoint_whose_manifest_does_not_parse(tmp_path, store):
    commit_checkpoint(stage(tmp_path, 10, FILES), store, RUN)
    store.put(store.key(RUN, "checkpoints", "step-00000010", "MANIFEST.json"), b"[")
    report = collect_garbage(store, RUN)
    assert report.removed == [] and "step-00000010" in report.kept[0]
    assert len(store.children(store.key(RUN, "checkpoints", "step-00000010"))) == 4


@LOCAL_ONLY
def test_local_writes_leave_no_temporary_files(tmp_path, store):
    staged = stage(tmp_path, 10, FILES)
    commit_checkpoint(staged, store, RUN)
    cleanup_staging(staged, store, RUN)
    leftovers = [p for p in tmp_path.rglob("*") if "rankflow-tmp" in p.name]
    assert leftovers == []
    assert os.listdir(tmp_path / "staging") == ["journals"]  # the journals, one directory per store
    assert sorted(p.name for p in journal_path_for(staged, store).parent.iterdir()) == [
        "STORE.json",
        "step-00000010.json",
    ]
