"""Real `rankflow run` processes of one config: one trains, the others wait or stop; a killed run is taken over.

Every process is the console script, as a user starts it, talking to the test
session's Prefect API. The run id is the same in every test (same config and
data; the work dir and store do not enter the digest), so the checkpoint of a
run that was raced, or killed and taken over, must equal, byte for byte, the
one trained once without interference.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from infra.publication.checkpoints import latest_checkpoint
from infra.runs import ledger
from infra.store import open_store
from tests.e2e.run_lease.runs import (
    client_env,
    committed_weights,
    finish,
    hanging_at,
    lease_of,
    raw_lease,
    run_id_of,
    start,
    steal,
    stepping,
    trained_segments,
    wait_for,
    write_config,
)
from trainer_core.run.state import has_state, state_dir_for

pytestmark = [pytest.mark.flow]


def test_two_runs_at_once_one_trains_the_other_exits_75_naming_the_holder(race):
    (code_a, _, _), (code_b, _, _) = race["results"]
    assert sorted([code_a, code_b]) == [0, 75], [r[2][-3000:] for r in race["results"]]
    winner = 0 if code_a == 0 else 1
    (_, won, _), (_, _, err) = race["results"][winner], race["results"][1 - winner]
    assert won["status"] == "completed" and won["segments_trained"] == 2 and won["steps"] == 6
    assert race["held"].pid == race["racers"][winner].pid  # the lease names the process that trained
    messages = [line for line in err.splitlines() if line.startswith("rankflow:")]
    assert len(messages) == 1, err[-3000:]
    assert messages[0].startswith(f"rankflow: run {race['run_id']} is already running: ")
    assert f"pid {race['racers'][winner].pid}" in messages[0] and "last heartbeat" in messages[0]
    assert "Traceback" not in err


def test_a_waiting_run_waits_for_the_holder_then_reuses_everything(race):
    code, summary, err = race["waiter"]
    assert code == 0, err[-3000:]
    assert (
        "waiting up to 900 s (run.lease_wait_s) for its run lease"
        in err + (race["root"] / "waiter" / "stdout.txt").read_text()
    )
    assert summary["segments_trained"] == 0 and summary["segments_reused"] == 2
    (_, won, _) = next(r for r in race["results"] if r[0] == 0)
    assert summary["checkpoint_url"] == won["checkpoint_url"]


def test_the_raced_run_trained_each_segment_once_and_released_its_lease(race):
    run_dir = race["root"] / "work" / race["run_id"]
    assert trained_segments(run_dir) == [0, 1]
    assert [e["status"] for e in ledger.read(run_dir) if e["stage"] == "plan"] == ["completed", "reused"]
    assert lease_of(race["store_url"], race["run_id"]) is None  # released at the end (the object stays, marked so)
    assert raw_lease(race["store_url"], race["run_id"]).generation == 2  # the trainer's, then the waiter's


def _other_host_prefix(root: Path) -> tuple[str, ...]:
    """Run as if on another machine (own hostname): its death can only be learned from the lease's expiry.

    Where a UTS namespace cannot be made (no CAP_SYS_ADMIN), the run stays on this
    machine and the next run takes it over at once instead (its process is gone).
    """
    prefix = ("unshare", "--uts", "sh", "-c", 'hostname other-node && exec "$0" "$@"')
    if shutil.which("unshare") is None or subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        return ()
    return prefix


def test_a_killed_run_is_taken_over_after_its_ttl_and_resumed(race, api_url, tmp_path):
    ttl_s = 8.0
    prefix = _other_host_prefix(tmp_path)
    config_file = write_config(tmp_path, run={"lease_ttl_s": ttl_s})
    run_id, store_url = run_id_of(config_file), str(tmp_path / "store")
    run_dir = tmp_path / "work" / run_id
    marker = tmp_path / "hanging"
    first = start(
        ["run", str(config_file)],
        {**client_env(api_url, tmp_path / "home-1"), **hanging_at(4, marker)},
        tmp_path / "first",
        prefix=prefix,
    )
    wait_for(lambda: marker.exists() or first.poll() is not None, 400, "the first run to reach step 4")
    assert first.poll() is None and stepping(run_dir, 1), (tmp_path / "first" / "stderr.txt").read_text()[-3000:]
    os.killpg(first.pid, signal.SIGKILL)  # mid-segment: segment 0 saved, segment 1 at step 4 of 3-5
    first.wait()
    dead = raw_lease(store_url, run_id)
    assert (
        dead.pid == first.pid and not dead.released and dead.host == ("other-node" if prefix else os.uname().nodename)
    )

    second = start(
        ["run", str(config_file), "--set", "run.lease_wait_s=120"],
        client_env(api_url, tmp_path / "home-2"),
        tmp_path / "second",
    )
    code, summary, err = finish(second, tmp_path / "second")
    assert code == 0, err[-3000:]
    assert summary["segments_reused"] == 1 and summary["segments_trained"] == 1  # resumed, nothing redone
    taken = raw_lease(store_url, run_id)
    assert taken.generation == dead.generation + 1 and taken.pid == second.pid and taken.released
    if prefix:  # another machine's holder: taken over only once its lease expired, ttl after its last heartbeat
        assert taken.acquired_at >= dead.expires_at and dead.expires_at - dead.renewed_at == pytest.approx(ttl_s)
    assert trained_segments(run_dir) == [0, 1]
    assert committed_weights(store_url, run_id) == committed_weights(race["store_url"], race["run_id"])


def test_a_run_whose_lease_is_taken_over_stops_without_writing(api_url, tmp_path):
    config_file = write_config(tmp_path)
    run_id, store_url = run_id_of(config_file), str(tmp_path / "store")
    run_dir = tmp_path / "work" / run_id
    marker = tmp_path / "hanging"
    first = start(
        ["run", str(config_file)],
        {**client_env(api_url, tmp_path / "home"), **hanging_at(1, marker)},
        tmp_path / "first",
    )
    wait_for(lambda: marker.exists() or first.poll() is not None, 400, "the run to reach step 1")
    assert first.poll() is None and stepping(run_dir, 0), (tmp_path / "first" / "stderr.txt").read_text()[-3000:]
    thief = steal(open_store(store_url), run_id)  # as a run on another machine that took the lease over would
    stolen_at = time.time()
    code, summary, err = finish(first, tmp_path / "first")
    assert code == 1, err[-3000:]
    # The launch (hung in step 1) was ended by the lease check, every 2 s, not by the 300 s stall watchdog.
    assert time.time() - stolen_at < 120
    assert summary["run_id"] == run_id and summary["failure_cause"] == "lease_lost"
    failed = [line for line in err.splitlines() if line.startswith("rankflow: run failed:")]
    assert len(failed) == 1 and "taken over by gpu-node-9:4242" in failed[0], err[-3000:]
    assert raw_lease(store_url, run_id) == thief  # never renewed over, never released over
    assert all(entry["time"] < stolen_at for entry in ledger.read(run_dir))  # nothing recorded after the theft
    assert trained_segments(run_dir) == [] and not has_state(state_dir_for(run_dir, 1))
    assert latest_checkpoint(open_store(store_url), run_id) is None
