"""A saved state's local record: the trust rule, digests computed once, the upload and the next launch reusing them.

References: hashlib's sha256 of the bytes on disk, the store's own bytes (a local store hashes where they lie),
and the inode a hard link shares. No launch: the state is written by `save_training_state` on a tiny model, or
as plain files with `write_record`.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from infra.runs.run_state import read_bundle_manifest, stored_bundle
from infra.store import open_store
from tasks import run_state
from tasks.outcomes import PlannedRun
from tasks.state_upload import upload_state_fn
from trainer_core.config import StorageSection
from trainer_core.run import state_record
from trainer_core.run.records import SegmentResult
from trainer_core.run.state import save_training_state, state_dir_for
from trainer_core.run.state_record import LocalState, LocalStateChanged, record_path, write_record

FILES = {
    "base/params.safetensors": os.urandom(300_000),
    "base/optimizer.safetensors": os.urandom(200_000),
    "meta.json": b"{}",
}


RESULT = SegmentResult(
    segment=0,
    start_step=0,
    end_step=3,
    losses=[1.0, 0.9, 0.8],
    grad_norms=[1.0, 1.0, 1.0],
    skipped_steps=[],
    num_skipped_steps=0,
    num_stale_trajectories=0,
    num_tokens=30,
    tokens_per_s=10.0,
    setup_s=0.1,
    train_s=3.0,
    save_s=0.1,
    peak_saved_bytes=0,
    world_size=1,
    logical_dp=1,
    reduction="deterministic",
    threads_per_process=1,
    state_dir="state/segment-0000",
    state_bytes=500_002,
)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def planned(tmp_path) -> PlannedRun:
    """A run of two segments whose segment 0 is saved here, with its record and result, and no upload yet."""
    run_dir = tmp_path / "work" / "run-1"
    state_dir = state_dir_for(run_dir, 0)
    for relative, data in FILES.items():
        (state_dir / relative).parent.mkdir(parents=True, exist_ok=True)
        (state_dir / relative).write_bytes(data)
    write_record(state_dir)
    RESULT.write(run_dir / "segments" / "segment-0000.json")
    return PlannedRun(
        run_id="run-1",
        digest="d" * 64,
        run_dir=str(run_dir),
        segment_steps=[(0, 3), (3, 6)],
        storage=StorageSection(url=str(tmp_path / "store")),
    )


def state_of(planned: PlannedRun) -> Path:
    return state_dir_for(Path(planned.run_dir), 0)


@pytest.fixture
def no_hashing(monkeypatch):
    """Fail the test if any file is hashed (the record's digests must be reused)."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("a file was hashed")

    monkeypatch.setattr(state_record, "size_and_sha256", refuse)
    monkeypatch.setattr("infra.store.verified.sha256_of_file", refuse)
    monkeypatch.setattr("infra.runs.run_state.sha256_of_file", refuse)


def write_in_place(path: Path, *, keep_mtime: bool) -> None:
    """Other bytes of the same size, written into the same inode (the mtime put back if asked)."""
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    with open(path, "r+b") as handle:
        handle.write(bytes(data))
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert path.stat().st_mtime_ns == before.st_mtime_ns
    assert path.stat().st_ino == before.st_ino and path.stat().st_size == before.st_size


def test_the_save_makes_the_state_durable_and_records_every_file(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    from trainer_core.training import OptimizerConfig, Trainer

    trainer = Trainer(torch.nn.Linear(4, 3))
    trainer.add_base_checkpoint(optimizer=OptimizerConfig(learning_rate=1e-3))
    state_dir = tmp_path / "state" / "segment-0000"
    save_training_state(state_dir, trainer.checkpoints, {"next_step": 3})
    files = sorted(p.relative_to(state_dir).as_posix() for p in state_dir.rglob("*") if p.is_file())
    local = LocalState.load(state_dir)
    assert local is not None and [entry.path for entry in local.record.files] == files
    tmp_dir = f"{state_dir}.tmp"
    for relative in files:  # each file fsync'd before the rename, the directories too
        assert f"{tmp_dir}/{relative}" in synced
    assert tmp_dir in synced and str(state_dir.parent) in synced
    local.check()  # untouched: trusted as it lies


def test_digests_are_computed_once_and_equal_the_bytes_sha256(planned, monkeypatch):
    local = LocalState.load(state_of(planned))
    assert local is not None
    hashed = []
    real = state_record.size_and_sha256
    monkeypatch.setattr(state_record, "size_and_sha256", lambda path: (hashed.append(path), real(path))[1])
    digests = local.digests()
    assert digests == {relative: (len(data), sha256(data)) for relative, data in FILES.items()}
    assert len(hashed) == len(FILES)
    again = LocalState.load(state_of(planned))  # from the record on disk
    assert again is not None and again.digests() == digests and len(hashed) == len(FILES)


@pytest.mark.parametrize("hashed_first", [False, True], ids=["before-hashing", "after-hashing"])
@pytest.mark.parametrize("keep_mtime", [False, True], ids=["mtime-changed", "mtime-put-back"])
def test_bytes_changed_in_place_are_not_trusted_before_or_after_hashing(planned, keep_mtime, hashed_first):
    if hashed_first:
        LocalState.load(state_of(planned)).digests()  # pyright: ignore[reportOptionalMemberAccess]
    path = state_of(planned) / "base/params.safetensors"
    write_in_place(path, keep_mtime=keep_mtime)
    local = LocalState.load(state_of(planned))
    assert local is not None and not local.untouched("base/params.safetensors")  # the ctime gives it away
    why = "no longer has the bytes its save wrote" if hashed_first else "changed after its save"
    with pytest.raises(LocalStateChanged, match=f"params.safetensors (is gone or )?{why}"):
        local.check()
    with pytest.raises(LocalStateChanged):
        local.digests()  # nor is it hashed into a digest


def test_a_changed_state_is_never_uploaded_and_its_local_copies_are_discarded(planned):
    LocalState.load(state_of(planned)).digests()  # pyright: ignore[reportOptionalMemberAccess]
    write_in_place(state_of(planned) / "base/optimizer.safetensors", keep_mtime=True)
    later = state_dir_for(Path(planned.run_dir), 1)
    later.mkdir(parents=True)  # a later segment resumed from it
    with pytest.raises(LocalStateChanged, match="optimizer.safetensors no longer has the bytes its save wrote"):
        upload_state_fn(planned, 0)
    store = open_store(planned.storage)
    assert read_bundle_manifest(store, planned.run_id, "segment-0000") is None
    assert not store.fs.exists(store.path(planned.run_id, "state/segment-0000/base/optimizer.safetensors"))
    assert not state_of(planned).exists() and not record_path(state_of(planned)).exists() and not later.exists()
    with pytest.raises(FileNotFoundError, match="neither in the store nor"):
        upload_state_fn(planned, 0)  # the rerun trains it again; the upload alone cannot invent it


def test_a_touched_file_with_the_same_bytes_is_hashed_again_and_trusted(planned):
    local = LocalState.load(state_of(planned))
    assert local is not None
    local.digests()
    os.utime(state_of(planned) / "meta.json")
    assert not local.untouched("meta.json")
    local.check()


@pytest.mark.parametrize("where", ["file", "extra", "directory", "state"])
def test_a_symlink_in_the_state_is_not_trusted(planned, tmp_path, where):
    state_dir = state_of(planned)
    LocalState.load(state_dir).digests()  # pyright: ignore[reportOptionalMemberAccess]
    outside = tmp_path / "outside"
    outside.mkdir()
    if where == "file":  # a link to a copy with the very same bytes
        (outside / "meta.json").write_bytes(FILES["meta.json"])
        (state_dir / "meta.json").unlink()
        (state_dir / "meta.json").symlink_to(outside / "meta.json")
    elif where == "extra":
        (state_dir / "extra.bin").symlink_to(outside)
    elif where == "directory":  # the very files (same inodes and times), moved out and linked back
        os.rename(state_dir / "base", outside / "base")
        (state_dir / "base").symlink_to(outside / "base")
    else:
        os.rename(state_dir, outside / "state")
        state_dir.symlink_to(outside / "state")
    local = LocalState.load(state_dir)
    assert local is not None
    with pytest.raises(LocalStateChanged):
        local.check()
    if where in ("directory", "state"):  # nothing is read through a link, even the saved bytes
        assert not local.untouched("base/params.safetensors")
        assert (
            run_state.saved_files(Path(planned.run_dir), 0)
            .keys()
            .isdisjoint({"state/segment-0000/base/params.safetensors"})
        )


def test_a_local_store_takes_the_files_by_hard_link_with_the_recorded_digests(planned, no_hashing_after_digests):
    figures = upload_state_fn(planned, 0)
    assert not figures["already_stored"] and figures["num_files_uploaded"] == len(FILES) + 1
    store = open_store(planned.storage)
    manifest = read_bundle_manifest(store, planned.run_id, "segment-0000")
    assert manifest is not None
    for relative, data in FILES.items():
        entry = manifest.entry(f"state/segment-0000/{relative}")
        assert (entry.size, entry.sha256) == (len(data), sha256(data))
        stored = Path(store.path(planned.run_id, entry.path))
        assert stored.stat().st_ino == (state_of(planned) / relative).stat().st_ino  # linked, not copied
    LocalState.load(state_of(planned)).check()  # pyright: ignore[reportOptionalMemberAccess]
    # restamped: the link changed the ctime only
    assert all(LocalState.load(state_of(planned)).untouched(r) for r in FILES)  # pyright: ignore[reportOptionalMemberAccess]


@pytest.fixture
def no_hashing_after_digests(planned, monkeypatch):
    """The digests computed once (by the record), then no file hashed by the upload or its manifest."""
    LocalState.load(state_of(planned)).digests()  # pyright: ignore[reportOptionalMemberAccess]

    def refuse(*_args, **_kwargs):
        raise AssertionError("a state file was hashed again")

    monkeypatch.setattr(state_record, "size_and_sha256", refuse)
    monkeypatch.setattr(
        "infra.runs.run_state.sha256_of_file",
        lambda path: refuse() if "state/" in str(path) else (path.stat().st_size, sha256(path.read_bytes())),
    )


def test_a_write_into_a_linked_file_is_caught_by_the_stores_own_check(planned):
    upload_state_fn(planned, 0)
    store = open_store(planned.storage)
    assert stored_bundle(store, planned.run_id, "segment-0000") is not None
    write_in_place(state_of(planned) / "base/params.safetensors", keep_mtime=True)  # both names, one inode
    assert stored_bundle(store, planned.run_id, "segment-0000") is None  # the store hashes what it holds


def test_the_next_launch_uses_the_local_state_before_its_upload_without_hashing(planned, no_hashing):
    run_state.fetch_segment_state(planned, 0)  # no bundle in the store yet: the record's trust rule alone
    with pytest.raises(FileNotFoundError, match="segment-0000.json is missing"):
        run_state.fetch_segment_state(planned, 0, stored_only=True)  # an export: only a stored state


def test_the_next_launch_after_the_upload_keeps_the_local_files_by_their_recorded_digests(planned, monkeypatch):
    upload_state_fn(planned, 0)
    (state_of(planned) / "meta.json").unlink()  # one file gone: fetched; the others kept without a read
    hashed = []
    real = run_state.fetch_bundle.__globals__["local_copy_matches"]
    monkeypatch.setitem(
        run_state.fetch_bundle.__globals__, "local_copy_matches", lambda p, e: (hashed.append(p), real(p, e))[1]
    )
    run_state.fetch_segment_state(planned, 0)
    assert [p.name for p in hashed] == ["meta.json"]
    assert (state_of(planned) / "meta.json").read_bytes() == FILES["meta.json"]


def test_an_upload_of_a_stored_bundle_is_a_cheap_no_op(planned, monkeypatch):
    upload_state_fn(planned, 0)
    monkeypatch.setattr(run_state, "publish_bundle", lambda *a, **k: pytest.fail("uploaded again"))
    assert upload_state_fn(planned, 0)["already_stored"]
