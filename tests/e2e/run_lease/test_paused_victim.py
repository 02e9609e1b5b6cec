"""A run paused past its ttl inside a commit or a state upload, its run lease taken over, writes nothing on resuming.

Real processes: the victim (tests/e2e/run_lease/paused_victim.py) holds its run
lease, enters the commit (or the state upload) and stops itself with SIGSTOP
at its first uploaded file, heartbeats included. The thief, a second holder
in this process, waits out the victim's real ttl and takes the lease over
through infra/store/lease.py, then the victim gets SIGCONT. Reference: the bytes in
the store and the ledger at the moment of the theft. Before the fix, the
victim wrote the rest of the data, the manifest, LATEST, the journal mirror
and a ledger line after the theft.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from infra.publication.commit import remote_dir
from infra.publication.latest import latest_path
from infra.runs import ledger
from infra.runs.run_lease import run_lease_path
from infra.runs.run_state import manifest_path
from infra.store import open_store
from infra.store.lease import Lease, read_lease
from tests.publication_helpers import random_files, stage
from tests.storage.processes import spawn, wait_ready
from trainer_core.run.segment_main import segment_result_path
from trainer_core.run.state import state_dir_for

RUN = "paused-victim-0123456789ab"
TTL_S = 2.0


def process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as handle:
        return handle.read().rsplit(b")", 1)[1].split()[0].decode()


def tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "leases" not in p.parts and not p.name.startswith(".")
    }


def steal_from_paused(victim, store) -> tuple[float, dict[str, bytes]]:
    """Wait until the victim stopped itself, take its run lease over after its ttl; (when, the store then)."""
    assert victim.stdout.readline().strip() == "stopping", victim.stderr.read()[-3000:]
    deadline = time.monotonic() + 30
    while process_state(victim.pid) != "T":
        assert time.monotonic() < deadline, "the victim never stopped"
        time.sleep(0.05)
    thief = Lease.for_run(store, RUN, "run", owner="thief-on-node-2", ttl_s=600)
    thief.acquire(wait_s=TTL_S * 10)  # the victim's process is alive (stopped): only its expiry lets the thief in
    stolen_at = time.time()
    return stolen_at, tree(Path(store.root))


def resume(victim) -> dict:
    os.kill(victim.pid, signal.SIGCONT)
    out, err = victim.communicate(timeout=120)
    assert victim.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _prepare_commit(root: Path) -> tuple[object, Path, list[str]]:
    store, run_dir = open_store(str(root / "store")), root / "work" / RUN
    run_dir.mkdir(parents=True)
    staged = stage(run_dir / "export", 8, random_files(4, 200_000), run_id=RUN)
    return store, run_dir, [store.url, RUN, str(run_dir), "commit", str(staged), "8", "--ttl-s", str(TTL_S)]


def _prepare_state(root: Path) -> tuple[object, Path, list[str]]:
    store, run_dir = open_store(str(root / "store")), root / "work" / RUN
    state_dir = state_dir_for(run_dir, 0)
    state_dir.mkdir(parents=True)
    for index in range(4):
        (state_dir / f"rank-{index}.safetensors").write_bytes(os.urandom(200_000))
    segment_result_path(run_dir, 0).parent.mkdir(parents=True)
    segment_result_path(run_dir, 0).write_text('{"segment": 0}')
    return store, run_dir, [store.url, RUN, str(run_dir), "state", "--ttl-s", str(TTL_S)]


@pytest.fixture(scope="module")
def victims(tmp_path_factory) -> dict:
    """Both victims, started at once (each in its own store): a victim's start is its imports (seconds, torch among
    them), so the second pays them while the first does. Each test then steals from its own, which by then may
    have been stopped for longer than its ttl: the theft still waits for nothing but the lease's expiry."""
    prepared = {
        "commit": _prepare_commit(tmp_path_factory.mktemp("commit")),
        "state": _prepare_state(tmp_path_factory.mktemp("state")),
    }
    started = {stage: spawn("tests.e2e.run_lease.paused_victim", args) for stage, (_, _, args) in prepared.items()}
    try:
        for victim in started.values():
            wait_ready(victim)
        yield {stage: (store, run_dir, started[stage]) for stage, (store, run_dir, _) in prepared.items()}
    finally:
        for process in started.values():  # never leave a stopped victim behind (its own process group)
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def test_a_commit_paused_past_its_ttl_publishes_nothing_after_the_theft(victims):
    store, run_dir, victim = victims["commit"]
    stolen_at, before = steal_from_paused(victim, store)
    result = resume(victim)
    assert result.get("error") == "RunLeaseLost" and "taken over by thief-on-node-2" in result["message"], result
    assert read_lease(store, run_lease_path(store, RUN)).owner == "thief-on-node-2"
    assert not store.fs.exists(f"{remote_dir(store, RUN, 8)}/MANIFEST.json")
    assert not store.fs.exists(latest_path(store, RUN))
    after = tree(Path(store.root))
    changed = sorted(path for path, data in after.items() if before.get(path) != data)
    # At most the data file that was in flight; no manifest, LATEST, journal mirror or queue entry.
    assert all(path.startswith(f"{RUN}/checkpoints/step-00000008/model-") for path in changed), changed
    assert [entry for entry in ledger.read(run_dir) if entry["time"] >= stolen_at] == []


def test_a_state_upload_paused_past_its_ttl_stores_no_bundle_after_the_theft(victims):
    store, run_dir, victim = victims["state"]
    stolen_at, before = steal_from_paused(victim, store)
    result = resume(victim)
    assert result.get("error") == "RunLeaseLost", result
    assert not store.fs.exists(manifest_path(store, RUN, "segment-0000"))
    after = tree(Path(store.root))
    changed = sorted(path for path, data in after.items() if before.get(path) != data)
    assert all(path.startswith((f"{RUN}/state/", f"{RUN}/segments/")) for path in changed), changed
    assert [entry for entry in ledger.read(run_dir) if entry["time"] >= stolen_at] == []
