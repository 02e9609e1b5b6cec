"""A run's warm process: torchrun's ranks are forked with their imports done, and behave as ranks started anew.

Real torchrun launches of a small module, with and without a warm process:
what the rank sees (arguments, working directory, environment, threads,
`__main__`), how it ends (exit status, a signal) as torchrun reports it, and
that no forked rank outlives its launch however it ends (a timeout, a stall,
its stand-in killed). A warm process that is gone, or that does not hold the
module, leaves the ranks to start by themselves.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from infra.launch.launcher import launch
from infra.launch.processes import is_stopped, rank_pids, wait_gone
from infra.launch.warm_ranks import DISABLE_ENV, launch_env, start_warm_process, warm_ranks
from tests.waits import wait_for
from trainer_core.run.warm_client import READY_WAIT_S

pytestmark = pytest.mark.distributed

GONE_S = 300.0
"""How long a process told to end may take to be gone on a loaded machine; at once on a quiet one."""

PROBE = "warm_probe"
PROBE_BODY = """
import sys
START_HAD_TORCH = "torch" in sys.modules  # before this module imports it: loaded already only in a forked rank
import json, os, signal, time
import torch  # what makes a warm start worth it

def _ended(record):  # whether the rank that wrote `record` has exited (gone, or a zombie not yet reaped)
    try:
        with open(record) as held:
            pid = json.load(held)["pid"]
    except (OSError, ValueError, KeyError):
        return False  # not written yet, or half written
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        return True

def main():
    rank = os.environ["RANK"]
    with open(os.path.join(os.environ["PROBE_OUT"], f"rank-{rank}.json"), "w") as out:
        json.dump({
            "pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv[1:], "cwd": os.getcwd(),
            "marker": os.environ.get("PROBE_MARKER"), "threads": torch.get_num_threads(),
            "forked": os.environ.get("RANKFLOW_WARM_FORKED"), "torch_loaded_at_start": START_HAD_TORCH,
        }, out)
    print(f"hello from rank {rank}", flush=True)
    if rank == "1":
        action = os.environ.get("PROBE_ACTION", "")
        if action.startswith("exit") or action in ("term", "kill"):
            # Rank 0 ends first (it has nothing else to do): a rank 0 still running when rank 1 ends is stopped by
            # torchrun, and two failures at once may name rank 0 the root cause (seen under a loaded suite).
            deadline = time.monotonic() + 600
            first = os.path.join(os.environ["PROBE_OUT"], "rank-0.json")
            while time.monotonic() < deadline and not _ended(first):
                time.sleep(0.02)
        if action.startswith("exit"):
            sys.exit(int(action[4:]))
        if action in ("term", "kill", "stop"):
            os.kill(os.getpid(), {"term": signal.SIGTERM, "kill": signal.SIGKILL, "stop": signal.SIGSTOP}[action])
        if action == "sleep":
            time.sleep(600)
        if action == "late3":
            time.sleep(4)
            sys.exit(3)
    if os.environ.get("PROBE_ACTION") == "sleep":
        time.sleep(600)

if __name__ == "__main__":
    main()
"""


@pytest.fixture
def probe(tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / f"{PROBE}.py").write_text(textwrap.dedent(PROBE_BODY))
    out = tmp_path / "out"
    out.mkdir()
    return {"PYTHONPATH": f"{code}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "PROBE_OUT": str(out)}


@pytest.fixture
def warm(probe):
    process = start_warm_process((PROBE,), env=probe)
    _wait_ready(process)
    yield process
    process.stop()


def _wait_ready(process) -> None:
    def ready() -> bool:
        assert process.process.poll() is None, (process.directory / "warm.log").read_text()
        return process.is_ready()

    wait_for(ready, "the warm process to be ready")


def _started(probe, *ranks) -> bool:
    return all((Path(probe["PROBE_OUT"]) / f"rank-{rank}.json").exists() for rank in ranks)


def _seen(probe, rank):
    return json.loads((Path(probe["PROBE_OUT"]) / f"rank-{rank}.json").read_text())


def _launch(probe, warm, timeout_s=600, monitor=None, **env):
    lines = []
    result = launch(
        PROBE,
        ["--flag", "value with spaces"],
        nproc_per_node=2,
        timeout_s=timeout_s,
        env={**probe, **(warm.env() if warm else {}), **env},
        on_line=lines.append,
        monitor=monitor,
    )
    return result, lines


def test_a_forked_rank_sees_what_a_rank_started_anew_sees(probe, warm):
    result, lines = _launch(probe, warm, PROBE_MARKER="the launch's own")
    assert result.returncode == 0, lines
    assert "[rank 0] hello from rank 0" in lines and "[rank 1] hello from rank 1" in lines  # its log files
    forked = [_seen(probe, rank) for rank in (0, 1)]
    cold, cold_lines = _launch(probe, None, PROBE_MARKER="the launch's own")
    assert cold.returncode == 0, cold_lines
    anew = [_seen(probe, rank) for rank in (0, 1)]
    for mine, reference in zip(forked, anew, strict=True):
        assert mine["ppid"] == warm.process.pid and reference["ppid"] != warm.process.pid
        assert mine["forked"] == "1" and reference["forked"] is None
        assert mine["torch_loaded_at_start"] and not reference["torch_loaded_at_start"]  # the imports were done
        for key in ("argv", "cwd", "marker", "threads"):
            assert mine[key] == reference[key], key
    assert anew[0]["argv"] == ["--flag", "value with spaces"] and anew[0]["marker"] == "the launch's own"


@pytest.mark.parametrize(
    ("action", "exit_status"), [("exit3", 3), ("term", -signal.SIGTERM), ("kill", -signal.SIGKILL)]
)
def test_torchrun_sees_a_forked_rank_end_as_it_ended(probe, warm, action, exit_status):
    result, lines = _launch(probe, warm, PROBE_ACTION=action)
    assert result.returncode != 0
    assert result.rank_exits.get(1) == exit_status, lines
    assert result.root_cause_rank == 1


def test_a_stalled_launch_names_the_stopped_forked_rank_and_leaves_no_rank(probe, warm):
    def monitor():
        # A stall once rank 1 has stopped itself (SIGSTOP): the launch then stops what is left, however long it took.
        try:
            stopped = is_stopped(_seen(probe, 1)["pid"])
        except (OSError, ValueError):
            return None  # rank 1 has not written its record yet, or is writing it
        return "no progress" if stopped else None

    lines = []
    result = launch(
        PROBE,
        [],
        nproc_per_node=2,
        timeout_s=600,
        env={**probe, **warm.env(), "PROBE_ACTION": "stop"},
        on_line=lines.append,
        monitor=monitor,
        poll_s=0.2,
    )
    assert result.stalled == "no progress"
    assert result.stopped_ranks == (1,), lines  # the forked process, not its stand-in, is the one stopped
    assert wait_gone([_seen(probe, 0)["pid"], _seen(probe, 1)["pid"]], GONE_S) == []


def test_a_timed_out_launch_leaves_no_forked_rank(probe, warm):
    def both_ranks_started() -> None:
        # Asked long before the 15 s pass: held until both ranks run, so the timeout ends forked ranks that exist.
        wait_for(lambda: _started(probe, 0, 1), "both ranks to start")

    result, _ = _launch(probe, warm, timeout_s=15, monitor=both_ranks_started, PROBE_ACTION="sleep")
    assert result.timed_out
    assert wait_gone([_seen(probe, 0)["pid"], _seen(probe, 1)["pid"]], GONE_S) == []
    assert not list((warm.directory / "children").iterdir())


def test_a_killed_stand_in_takes_its_forked_rank_with_it(probe, warm):
    import threading

    results = []
    launching = threading.Thread(target=lambda: results.append(_launch(probe, warm, PROBE_ACTION="sleep")))
    launching.start()
    wait_for(lambda: _started(probe, 0, 1), "both ranks to start")
    forked = _seen(probe, 1)["pid"]
    torchrun = next(
        p for p in psutil.Process().children(recursive=True) if "loopback_torchrun" in " ".join(p.cmdline())
    )
    ranks = rank_pids(torchrun.pid)
    assert ranks[1] == forked  # the launcher resolves the stand-in to the process it stands in for
    stand_in = next(c.pid for c in torchrun.children() if c.environ().get("RANK") == "1")
    os.kill(stand_in, signal.SIGKILL)
    assert wait_gone([forked], GONE_S) == []
    launching.join(GONE_S)
    ((result, _),) = results
    assert result.returncode != 0 and result.rank_exits.get(1) == -signal.SIGKILL


def test_ranks_start_by_themselves_when_the_warm_process_is_gone_or_lacks_the_module(probe, warm):
    other = {**warm.env(), "RANKFLOW_WARM_MODULES": "trainer_core.run.segment_main"}  # not the probe
    result, lines = _launch(probe, None, **other)
    assert result.returncode == 0, lines
    assert _seen(probe, 0)["forked"] is None
    warm.process.kill()
    warm.process.wait()
    result, lines = _launch(probe, warm)
    assert result.returncode == 0, lines
    assert _seen(probe, 1)["forked"] is None and _seen(probe, 1)["ppid"] != warm.process.pid


def test_warm_ranks_starts_one_process_per_context_and_stops_it(monkeypatch):
    with warm_ranks(("json",)) as warm:
        assert warm is not None and launch_env()["RANKFLOW_WARM_PID"] == str(warm.process.pid)
        with warm_ranks(("json",)) as inner:
            assert inner is warm  # a flow inside `rankflow run` uses the one the command started
        _wait_ready(warm)
    assert warm.process.poll() is not None and not warm.directory.exists()
    assert launch_env() == {}
    monkeypatch.setenv(DISABLE_ENV, "0")
    with warm_ranks(("json",)) as none:
        assert none is None and launch_env() == {}


SLEEPER = """
import time
if __name__ == "__main__":
    time.sleep(2)
"""


def _ready_light_process(tmp_path):
    (tmp_path / "warm_sleeper.py").write_text(SLEEPER)
    process = start_warm_process(("warm_sleeper",), env={"PYTHONPATH": str(tmp_path)})
    _wait_ready(process)
    return process


def _request(path, module, fds):
    import socket

    from trainer_core.run.warm_client import HEADER

    body = json.dumps({"module": module, "args": [], "cwd": os.getcwd(), "env": dict(os.environ), "client_pid": 1})
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(str(path))
    connection.settimeout(30)
    socket.send_fds(connection, [HEADER.pack(len(body))], fds)
    connection.sendall(body.encode())
    return connection


def _cpu_s(pid):
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def test_the_warm_process_refuses_what_it_cannot_serve_and_keeps_serving(tmp_path):
    import socket

    warm = _ready_light_process(tmp_path)
    try:
        with open(os.devnull, "rb") as null_in, open(os.devnull, "wb") as null_out:
            fds = [null_in.fileno(), null_out.fileno(), null_out.fileno()]
            assert _request(warm.socket_path, "not_served", fds).recv(64) == b"no\n"
            assert _request(warm.socket_path, "warm_sleeper", fds[:1]).recv(64) == b"no\n"  # not the three streams
            junk = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            junk.connect(str(warm.socket_path))
            junk.sendall(b"\xff" * 64)  # no request: dropped, nothing forked
            junk.settimeout(30)
            assert junk.recv(64) == b""
            served = _request(warm.socket_path, "warm_sleeper", fds)
            assert served.recv(64).decode().startswith("ok ")
            served.sendall(b"chatter after the request")  # read and ignored while the child sleeps: no busy loop
            before = _cpu_s(warm.process.pid)
            time.sleep(1.0)
            assert _cpu_s(warm.process.pid) - before < 0.3
            status = served.recv(64)
            while not status.endswith(b"\n"):
                status += served.recv(64)
            assert status == b"exit 0\n"
    finally:
        warm.stop()


def test_ranks_start_by_themselves_at_once_when_the_warm_directory_was_removed(probe, warm):
    import shutil

    shutil.rmtree(warm.directory)  # a /tmp cleaner: the socket is gone, the process is not
    started = time.monotonic()
    result, lines = _launch(probe, warm)
    assert result.returncode == 0, lines
    assert _seen(probe, 0)["forked"] is None and time.monotonic() - started < READY_WAIT_S  # not the ranks' wait


def test_a_warm_process_that_cannot_start_leaves_the_run_without_one(monkeypatch):
    import tempfile

    def no_room(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tempfile, "mkdtemp", no_room)
    with warm_ranks(("json",)) as none:
        assert none is None and launch_env() == {}


def test_a_rank_whose_warm_process_is_stopped_still_ends_as_it_ended(probe, warm):
    import threading

    results = []
    launching = threading.Thread(target=lambda: results.append(_launch(probe, warm, PROBE_ACTION="late3")))
    launching.start()
    wait_for(lambda: _started(probe, 1), "rank 1 to start")
    os.kill(warm.process.pid, signal.SIGSTOP)  # its children run on; it can neither reap them nor report
    try:
        # the next launch would not name it, once the signal has stopped it
        wait_for(lambda: not warm.is_usable(), "the stopped warm process to be unusable")
        launching.join(GONE_S)
        assert not launching.is_alive()
        ((result, lines),) = results
        # The rank's own exit status, seen by its stand-in without the stopped warm process: not the launch's timeout.
        assert not result.timed_out and result.rank_exits.get(1) == 3 and _seen(probe, 1)["forked"] == "1", lines
    finally:
        os.kill(warm.process.pid, signal.SIGCONT)


def test_warm_directories_of_dead_owners_are_removed_and_others_kept(tmp_path):
    from infra.launch.warm_ranks import OWNER_FILE, PREFIX, remove_orphaned_directories

    dead = psutil.Popen(["true"])
    dead.wait()
    orphaned, owned, making = (tmp_path / f"{PREFIX}{name}" for name in ("orphaned", "owned", "making"))
    for directory in (orphaned, owned, making):
        directory.mkdir()
    (orphaned / OWNER_FILE).write_text(str(dead.pid))
    (owned / OWNER_FILE).write_text(str(os.getpid()))
    assert remove_orphaned_directories(tmp_path) == [orphaned]
    assert not orphaned.exists() and owned.exists() and making.exists()


def test_starting_a_warm_process_removes_the_directory_a_killed_run_left():
    from infra.launch.warm_ranks import OWNER_FILE, PREFIX

    dead = psutil.Popen(["true"])
    dead.wait()
    left = Path("/tmp") / f"{PREFIX}left-by-a-killed-run-{uuid.uuid4().hex[:8]}"  # another suite may run beside
    left.mkdir()
    (left / OWNER_FILE).write_text(str(dead.pid))
    (left / "socket").write_text("")
    warm = start_warm_process(("json",))
    try:
        assert not left.exists() and warm.directory.exists()
        assert (warm.directory / OWNER_FILE).read_text() == str(os.getpid())
    finally:
        warm.stop()
        shutil.rmtree(left, ignore_errors=True)
