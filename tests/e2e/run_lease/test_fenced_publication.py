"""A run lease taken over while a commit, a cleanup or a state upload is in flight stops it there.

The victim holds its run lease and is inside the finalizer-held section when
another holder takes the run lease over (a real takeover through
infra/store/lease.py: the thief's clock is an hour ahead, so the victim's lease looks
long expired, as it does to a run on another machine once the victim was paused
past its ttl). Reference: the bytes in the store and the run's ledger at the
moment of the theft. After it the victim may finish the data file in flight,
but writes no manifest, does not move LATEST, mirrors no journal, records no
ledger line. Before: it wrote all of them (only the finalizer lease was
checked, and the victim still held that).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import pytest

import tasks.publish as publish_module
from infra.publication.commit import commit_checkpoint, remote_dir
from infra.publication.latest import latest_path
from infra.runs import ledger
from infra.runs.run_lease import RunLeaseLost, acquire_run_lease, run_lease_path
from infra.runs.run_state import manifest_path
from infra.store import open_store
from infra.store.lease import Lease, LeaseRecord
from tasks.outcomes import ExportOutcome, PlannedRun
from tasks.publish import cleanup_fn, commit_fn
from tasks.run_state import publish_segment_state
from tests.publication_helpers import random_files, stage
from trainer_core.config import StorageSection, TrainSection
from trainer_core.run.segment_main import segment_result_path
from trainer_core.run.state import state_dir_for

RUN = "fenced-run-0123456789ab"


class Theft:
    """Takes the run lease over at the first event `when` accepts; remembers what the store held then."""

    def __init__(self, store, when):
        self.store, self.when = store, when
        self.thief = Lease.for_run(
            store, RUN, "run", owner="gpu-node-9:4242", ttl_s=600, clock=lambda: time.time() + 3600
        )
        self.at: float | None = None
        self.snapshot: dict[str, bytes] = {}

    def __call__(self, event: str) -> None:
        if self.at is None and self.when(event):
            self.thief.acquire()
            self.at = time.time()
            self.snapshot = tree(self.store)

    def check_stolen(self) -> None:
        assert self.at is not None, "the theft never happened"
        stored = LeaseRecord.from_bytes(self.store.fs.cat_file(run_lease_path(self.store, RUN)))
        assert stored.owner == "gpu-node-9:4242"


def tree(store) -> dict[str, bytes]:
    """Every object under the store's root but the leases (and a local store's lock files), with its bytes."""
    try:
        paths = store.fs.find(store.root)
    except FileNotFoundError:
        return {}
    relative = {path: path.removeprefix(store.root.rstrip("/") + "/") for path in paths}
    return {
        name: store.fs.cat_file(path)
        for path, name in sorted(relative.items())
        if "/leases/" not in f"/{name}" and not name.rsplit("/", 1)[-1].startswith(".")
    }


def written_after(theft: Theft) -> dict[str, bytes]:
    """Objects the victim created or changed after the theft."""
    now = tree(theft.store)
    return {path: data for path, data in now.items() if theft.snapshot.get(path) != data}


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store(request, tmp_path):
    if request.param == "local":
        return open_store(str(tmp_path / "store"))
    request.getfixturevalue("s3_env")
    return open_store(request.getfixturevalue("s3_bucket_url"))


@pytest.fixture
def victim(store, tmp_path):
    lease = acquire_run_lease(store, RUN, ttl_s=30, wait_s=0)
    planned = PlannedRun(
        run_id=RUN,
        digest="d" * 64,
        run_dir=str(tmp_path / "work" / RUN),
        segment_steps=[(0, 4), (4, 8)],
        train=TrainSection(segment_timeout_s=60),
        storage=StorageSection(url=store.url),
        lease_token=lease.record.token,
    )
    yield planned
    lease.stop_heartbeat()


def exported(planned: PlannedRun, step: int, files: dict[str, bytes]) -> ExportOutcome:
    staged = stage(Path(planned.run_dir) / "export", step, files, run_id=RUN)
    return ExportOutcome(
        segment=0 if step == 4 else 1,
        step=step,
        staged_dir=str(staged),
        reused=False,
        num_files=len(files) + 1,
        num_bytes=sum(map(len, files.values())),
        launch_wall_s=0.0,
    )


def with_observer(monkeypatch, name: str, observer) -> None:
    real = getattr(publish_module, name)
    monkeypatch.setattr(publish_module, name, functools.partial(real, observer=observer))


def ledger_after(planned: PlannedRun, at: float) -> list[dict]:
    return [entry for entry in ledger.read(Path(planned.run_dir)) if entry["time"] >= at]


def test_a_commit_whose_run_lease_is_stolen_mid_upload_publishes_nothing(store, victim, monkeypatch):
    earlier = commit_fn(victim, exported(victim, 4, random_files(2, 3000)))  # LATEST → step 4, before any theft
    assert store.fs.cat_file(latest_path(store, RUN)).find(b"step-00000004") >= 0
    theft = Theft(store, lambda event: event.startswith("uploaded "))
    with_observer(monkeypatch, "commit_checkpoint", theft)
    with pytest.raises(RunLeaseLost, match="taken over by gpu-node-9:4242"):
        commit_fn(victim, exported(victim, 8, random_files(4, 3000)))
    theft.check_stolen()
    base = remote_dir(store, RUN, 8)
    assert not store.fs.exists(f"{base}/MANIFEST.json")
    changed = written_after(theft)
    # Only data files of step 8 that were already on their way; no manifest, LATEST, journal mirror or queue entry.
    assert all(path.startswith(f"{RUN}/checkpoints/step-00000008/model-") for path in changed), sorted(changed)
    assert ledger_after(victim, theft.at) == []
    assert earlier.step == 4


def test_a_commit_whose_run_lease_is_stolen_before_latest_does_not_move_it(store, victim, monkeypatch):
    commit_fn(victim, exported(victim, 4, random_files(1, 1000)))
    latest_before = store.fs.cat_file(latest_path(store, RUN))
    theft = Theft(store, lambda event: event == "manifest-written")
    with_observer(monkeypatch, "commit_checkpoint", theft)
    with pytest.raises(RunLeaseLost):
        commit_fn(victim, exported(victim, 8, random_files(1, 1000)))
    theft.check_stolen()
    assert store.fs.cat_file(latest_path(store, RUN)) == latest_before
    assert written_after(theft) == {} and ledger_after(victim, theft.at) == []


def test_a_cleanup_whose_run_lease_is_stolen_records_no_outcome(store, victim, monkeypatch):
    staged = exported(victim, 4, random_files(1, 1000))
    commit_fn(victim, staged)
    theft = Theft(store, lambda event: event == "cleanup-lease")
    with_observer(monkeypatch, "cleanup_staging", theft)
    with pytest.raises(RunLeaseLost):
        cleanup_fn(victim, staged)
    theft.check_stolen()
    assert written_after(theft) == {} and ledger_after(victim, theft.at) == []


def test_a_state_upload_whose_run_lease_is_stolen_stores_no_bundle(store, victim):
    run_dir = Path(victim.run_dir)
    state_dir = state_dir_for(run_dir, 0)
    state_dir.mkdir(parents=True)
    for index in range(4):
        (state_dir / f"rank-{index}.safetensors").write_bytes(bytes([index]) * 4000)
    segment_result_path(run_dir, 0).parent.mkdir(parents=True, exist_ok=True)
    segment_result_path(run_dir, 0).write_text('{"segment": 0}')
    theft = Theft(store, lambda event: event.startswith("uploaded "))
    with pytest.raises(RunLeaseLost, match="taken over by gpu-node-9:4242"):
        publish_segment_state(victim, 0, observer=theft)
    theft.check_stolen()
    assert not store.fs.exists(manifest_path(store, RUN, "segment-0000"))
    changed = written_after(theft)
    assert all(path.startswith(f"{RUN}/state/") or path.startswith(f"{RUN}/segments/") for path in changed), sorted(
        changed
    )
    assert ledger_after(victim, theft.at) == []


def test_an_unstolen_commit_still_publishes(store, victim):
    """The checks cost reads, not outcomes: with the lease held the commit is the same as before."""
    staged = exported(victim, 4, random_files(3, 2000))
    outcome = commit_fn(victim, staged)
    assert outcome.latest_moved and store.fs.exists(f"{remote_dir(store, RUN, 4)}/MANIFEST.json")
    assert commit_checkpoint(Path(staged.staged_dir), store, RUN).already_committed
