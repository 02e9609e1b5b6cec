"""Retention of checkpoints (storage.keep_last / keep_every) on a local and an in-memory store.

Which checkpoints survive is compared with a reference computed per checkpoint
(its rank from the newest, its step, LATEST), not with the rule's own code;
removal is checked in the store's bytes: no manifest, no object, a retired
record. A reader that pulls while the gc runs keeps its checkpoint (a real
download in a thread, paused between files); a gc without the finalizer lease
refuses; a gc killed between hiding a checkpoint and removing its data leaves
it invisible, and the next gc finishes.
"""

from __future__ import annotations

import contextlib
import itertools
import threading

import pytest

import infra.publication.checkpoints as checkpoints_module
import infra.publication.retention as retention_module
from infra.publication.checkpoints import download_checkpoint, list_checkpoints, pull_checkpoint
from infra.publication.commit import commit_checkpoint
from infra.publication.finalizer import FINALIZER_LEASE, FinalizerSettings
from infra.publication.latest import LatestPointer, latest_path, read_latest
from infra.publication.manifests import checkpoint_key, checkpoint_name, retired_key
from infra.publication.orphans import collect_garbage
from infra.publication.retention import RetentionPolicy, apply_retention, checkpoints_to_keep, is_retired
from infra.store import open_store
from infra.store.lease import Lease, LeaseHeldError
from infra.store.objects import list_files
from tests.publication_helpers import RUN, random_files, stage
from tests.store_fixtures import memory_or_local_store

STEPS = [10, 20, 30, 40, 50, 60]
QUICK = FinalizerSettings(wait_s=5.0, poll_s=0.05)


def reference_survivors(steps: list[int], keep_last: int | None, keep_every: int | None, latest: int) -> set[int]:
    """Per checkpoint: kept when among the keep_last newest, a multiple of keep_every, LATEST's, or the newest."""
    if keep_last is None:
        return set(steps)
    kept = set()
    for step in steps:
        rank_from_newest = sum(1 for other in steps if other > step)
        if rank_from_newest < keep_last or (keep_every and step % keep_every == 0) or step in (latest, max(steps)):
            kept.add(step)
    return kept


store = memory_or_local_store  # the fixture, under the name these tests use


def commit_steps(store, tmp_path, steps=STEPS) -> None:
    for step in steps:
        commit_checkpoint(stage(tmp_path / f"s{step}", step, random_files(2, 3000)), store, RUN)


def objects_of(store, step: int) -> dict[str, int]:
    return list_files(store, store.path(checkpoint_key(RUN, checkpoint_name(step))))


@pytest.mark.parametrize(
    ("keep_last", "keep_every", "latest"),
    [(None, None, 60), (1, None, 60), (2, None, 60), (2, 30, 60), (1, 20, 60), (3, 25, 60), (1, None, 30), (9, 7, 60)],
)
def test_the_checkpoints_that_survive(keep_last, keep_every, latest):
    expected = reference_survivors(STEPS, keep_last, keep_every, latest)
    assert checkpoints_to_keep(STEPS, RetentionPolicy(keep_last, keep_every), latest) == expected


def test_every_combination_against_the_reference():
    for keep_last, keep_every, latest in itertools.product([None, 1, 2, 4], [None, 1, 3, 20], STEPS):
        if keep_every is not None and keep_last is None:
            continue  # refused by the config
        expected = reference_survivors(STEPS, keep_last, keep_every, latest)
        assert checkpoints_to_keep(STEPS, RetentionPolicy(keep_last, keep_every), latest) == expected


def test_retention_removes_the_others_from_the_store(store, tmp_path):
    commit_steps(store, tmp_path)
    report = apply_retention(store, RUN, RetentionPolicy(keep_last=2, keep_every=30), QUICK)
    assert list_checkpoints(store, RUN) == [checkpoint_name(s) for s in (30, 50, 60)]
    assert report.removed == [checkpoint_name(s) for s in (10, 20, 40)] and report.removed_bytes == 3 * 6000
    for step in (10, 20, 40):
        assert objects_of(store, step) == {} and is_retired(store, RUN, step)
    assert read_latest(store, RUN) == {"checkpoint": checkpoint_name(60), "step": 60}
    again = apply_retention(store, RUN, RetentionPolicy(keep_last=2, keep_every=30), QUICK)
    assert again.removed == [] and list_checkpoints(store, RUN) == [checkpoint_name(s) for s in (30, 50, 60)]


def test_keep_last_unset_keeps_everything(store, tmp_path):
    commit_steps(store, tmp_path, [10, 20])
    assert apply_retention(store, RUN, RetentionPolicy(), QUICK).removed == []
    assert list_checkpoints(store, RUN) == [checkpoint_name(10), checkpoint_name(20)]


def test_the_checkpoint_latest_names_is_never_removed(store, tmp_path):
    commit_steps(store, tmp_path, [10, 20, 30])
    store.put(store.key_of(latest_path(store, RUN)), LatestPointer.at(20).to_bytes())  # LATEST behind the newest
    apply_retention(store, RUN, RetentionPolicy(keep_last=1), QUICK)
    assert list_checkpoints(store, RUN) == [checkpoint_name(20), checkpoint_name(30)]


def test_a_gc_without_the_finalizer_lease_refuses_and_removes_nothing(tmp_path):
    store = open_store(str(tmp_path / "store"))
    commit_steps(store, tmp_path, [10, 20])
    with Lease.for_run(store, RUN, FINALIZER_LEASE, owner="a committer elsewhere", ttl_s=30).hold():
        with pytest.raises(LeaseHeldError, match="a committer elsewhere"):
            apply_retention(store, RUN, RetentionPolicy(keep_last=1), FinalizerSettings(wait_s=0.3, poll_s=0.05))
    assert list_checkpoints(store, RUN) == [checkpoint_name(10), checkpoint_name(20)]


def test_a_gc_killed_after_hiding_leaves_no_visible_checkpoint_and_the_next_finishes(store, tmp_path, monkeypatch):
    commit_steps(store, tmp_path, [10, 20])
    real_remove = retention_module.remove_files

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("gc killed")

    monkeypatch.setattr(retention_module, "remove_files", killed)
    with pytest.raises(KeyboardInterrupt):
        apply_retention(store, RUN, RetentionPolicy(keep_last=1), QUICK)
    assert list_checkpoints(store, RUN) == [checkpoint_name(20)]  # step 10: data left, never visible
    assert objects_of(store, 10) and is_retired(store, RUN, 10)
    with pytest.raises(FileNotFoundError, match="retention removed it"):
        download_checkpoint(store, RUN, checkpoint_name(10), tmp_path / "pulled")
    monkeypatch.setattr(retention_module, "remove_files", real_remove)
    report = apply_retention(store, RUN, RetentionPolicy(keep_last=1), QUICK)
    assert report.removed == [checkpoint_name(10)] and objects_of(store, 10) == {}


class PausedPull:
    """A real `download_checkpoint` in a thread, paused after its first file until released."""

    def __init__(self, store, step: int, dest):
        self.after_first_file, self.release = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        real_fetch = checkpoints_module.fetch_verified

        def fetch_then_pause(*args, **kwargs):
            fetched = real_fetch(*args, **kwargs)
            self.after_first_file.set()
            assert self.release.wait(300)  # until finish(): a loaded machine may take long to get there
            return fetched

        self._patch = pytest.MonkeyPatch()
        self._patch.setattr(checkpoints_module, "fetch_verified", fetch_then_pause)

        def pull():
            try:
                download_checkpoint(store, RUN, checkpoint_name(step), dest)
            except BaseException as error:  # noqa: BLE001 - the test asserts on it
                self.error = error

        self.thread = threading.Thread(target=pull)
        self.thread.start()
        assert self.after_first_file.wait(300)

    def finish(self) -> None:
        self.release.set()
        self.thread.join(300)
        self._patch.undo()


def test_a_checkpoint_being_pulled_is_kept_until_the_reader_is_done(store, tmp_path):
    commit_steps(store, tmp_path, [10, 20])
    pull = PausedPull(store, 10, tmp_path / "pulled")
    try:
        report = apply_retention(store, RUN, RetentionPolicy(keep_last=1), QUICK)
        assert report.kept_for_readers == [checkpoint_name(10)] and report.removed == []
        assert collect_garbage(store, RUN).removed == []  # the orphan gc leaves it alone too
    finally:
        pull.finish()
    assert pull.error is None and (tmp_path / "pulled" / "MANIFEST.json").is_file()  # verified, whole
    assert apply_retention(store, RUN, RetentionPolicy(keep_last=1), QUICK).removed == [checkpoint_name(10)]


def test_a_reader_that_arrives_between_the_checks_keeps_the_data_of_a_hidden_checkpoint(store, tmp_path, monkeypatch):
    """The race the two checks close: the reader's marker appears after the first check, before the manifest goes."""
    commit_steps(store, tmp_path, [10, 20])
    real_live = retention_module.live_readers
    pulls: list[PausedPull] = []

    def reader_arrives_after_the_first_check(*args, **kwargs):
        found = real_live(*args, **kwargs)
        if not pulls:
            pulls.append(PausedPull(store, 10, tmp_path / "pulled"))  # read the manifest, marker up
        return found

    monkeypatch.setattr(retention_module, "live_readers", reader_arrives_after_the_first_check)
    try:
        report = apply_retention(store, RUN, RetentionPolicy(keep_last=1), QUICK)
        assert report.hidden == [checkpoint_name(10)] and report.removed == []
        assert list_checkpoints(store, RUN) == [checkpoint_name(20)]  # hidden from new readers at once
        assert collect_garbage(store, RUN).removed == []
    finally:
        with contextlib.suppress(IndexError):
            pulls[0].finish()
    assert pulls[0].error is None and (tmp_path / "pulled" / "MANIFEST.json").is_file()
    monkeypatch.setattr(retention_module, "live_readers", real_live)
    assert apply_retention(store, RUN, RetentionPolicy(keep_last=1), QUICK).removed == [checkpoint_name(10)]
    assert objects_of(store, 10) == {} and store.get(retired_key(RUN, 10)) is not None


def test_a_pull_of_latest_after_retention_gets_the_newest(store, tmp_path):
    commit_steps(store, tmp_path, [10, 20, 30])
    apply_retention(store, RUN, RetentionPolicy(keep_last=1), QUICK)
    name, path, _ = pull_checkpoint(store, RUN, tmp_path / "latest")
    assert name == checkpoint_name(30) and (path / "MANIFEST.json").is_file()
    assert list(store.children(f"{RUN}/readers/{checkpoint_name(30)}")) == []  # the marker is gone


def test_retention_settings_do_not_change_the_run_id(tmp_path):
    """What stays in the store is not what is trained: the digest (and so the run id) ignores the keep_* keys."""
    from tests.conftest import tiny_tree
    from trainer_core.config import config_from_dict
    from trainer_core.run.plan import digest_view

    plain = config_from_dict(tiny_tree(tmp_path), config_dir=tmp_path)
    kept = config_from_dict(
        tiny_tree(tmp_path, storage={"keep_last": 2, "keep_every": 10, "keep_states": True}), config_dir=tmp_path
    )
    assert kept.storage.keep_last == 2 and digest_view(kept) == digest_view(plain)


def test_a_reader_that_may_not_write_to_the_store_still_pulls_a_verified_checkpoint(store, tmp_path, monkeypatch):
    """Read-only credentials (an inference server's) pulled checkpoints before reader markers existed: they still do.

    The download is verified against the manifest as always; only the marker, which needs a write, is left out."""
    commit_steps(store, tmp_path, [10, 20])
    real_put = type(store).put

    def refuse_reader_markers(self, key, *args, **kwargs):
        if "/readers/" in str(key):
            raise PermissionError(13, "Access Denied", str(key))
        return real_put(self, key, *args, **kwargs)

    monkeypatch.setattr(type(store), "put", refuse_reader_markers)
    name, path, _ = pull_checkpoint(store, RUN, tmp_path / "pulled")
    assert name == checkpoint_name(20)
    pulled = {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}
    stored = {rel: store.fs.cat_file(f"{store.path(checkpoint_key(RUN, name))}/{rel}") for rel in pulled}
    assert pulled == stored and "MANIFEST.json" in pulled
