"""A `rankflow run` killed in the first seconds of a launch leaves no process of it behind.

Each trial starts a launcher in a session of its own (as `rankflow run` is
started from a shell), lets the launch run a seeded random time, then
SIGKILLs the launcher's whole process group, as a user's kill would: half
the trials at a point of the launch's first 10 s (torchrun starting), half
at a point of the ranks' first 4 s (the ranks importing torch: how long
after the launch starts depends on the machine's load). The reference is
/proc: every process carrying the trial's mark (torchrun and every rank
inherit it) must end, wherever it was re-parented; it is waited for with a
bound far above what any load makes it take (it ends within a second when
quiet), so a survivor is one the kill left behind, not a slow machine.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from tests.processes import descendants, pid_alive
from tests.waits import wait_for

pytestmark = pytest.mark.distributed

NUM_TRIALS_PER_WINDOW = 3
WINDOWS_S = {"launch": 10.0, "ranks": 4.0}
"""Where the kill falls: within this many seconds of the launch's start, or of the first rank's appearance."""
SURVIVAL_LIMIT_S = 120.0
"""How long a killed launch's processes may take to end on a loaded machine before they count as left behind."""
_MARK = "RANKFLOW_TEST_LAUNCH_TRIAL"

# A rank whose first import takes seconds (trainer_core and torch), as the segment and export entry points do.
_RANK = """
    import time
    from trainer_core.run.distributed import run_rank_main

    run_rank_main(lambda: time.sleep(600))
"""
_LAUNCHER = """
    import sys
    from pathlib import Path
    from infra.launch.launcher import launch

    Path(sys.argv[1]).write_text("launching")  # the launch starts now: the trial's clock starts here
    launch("slow_import_rank", [], nproc_per_node=2, timeout_s=600, on_line=lambda _: None)
"""


def _marked(token: str) -> list[int]:
    """Live (non-zombie) processes whose environment carries this trial's mark."""
    wanted = f"{_MARK}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if wanted in environ.split(b"\0") and pid_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def _left_after_kill(token: str) -> list[int]:
    """The trial's processes still alive once they have all ended or SURVIVAL_LIMIT_S has passed."""
    deadline = time.monotonic() + SURVIVAL_LIMIT_S
    while (left := _marked(token)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _ranks_started(pids: list[int]) -> int:
    count = 0
    for pid in pids:
        try:
            count += any(item.startswith(b"RANK=") for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
    return count


def test_a_kill_at_a_random_point_of_a_launch_s_first_10_s_leaves_no_process(tmp_path):
    (tmp_path / "slow_import_rank.py").write_text(textwrap.dedent(_RANK))
    (tmp_path / "launcher.py").write_text(textwrap.dedent(_LAUNCHER))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    rng = random.Random(14)
    trials = [
        (window, rng.uniform(0.0, length_s))
        for window, length_s in WINDOWS_S.items()
        for _ in range(NUM_TRIALS_PER_WINDOW)
    ]
    survivors: dict[str, list[int]] = {}
    try:
        for trial, (window, delay_s) in enumerate(trials):
            token = uuid.uuid4().hex
            started = tmp_path / f"started-{trial}"
            launcher = subprocess.Popen(
                [sys.executable, str(tmp_path / "launcher.py"), str(started)],
                env={**env, _MARK: token},
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            wait_for(started.exists, "the launcher to start its launch")
            if window == "ranks":
                wait_for(lambda: _ranks_started(descendants(launcher.pid)), "a rank to start")  # noqa: B023
            time.sleep(delay_s)  # the kill's random point in the window, not a wait for an event
            in_launch = descendants(launcher.pid)
            num_ranks = _ranks_started(in_launch)
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
            left = _left_after_kill(token)
            print(
                f"trial {trial}: killed {delay_s:.1f} s after the {window} started, {len(in_launch)} launch processes "
                f"({num_ranks} ranks) then; alive {SURVIVAL_LIMIT_S:g} s later: {left}"
            )
            if left:
                survivors[f"trial {trial} (kill {delay_s:.1f} s after the {window} started)"] = left
                for pid in left:  # never leave them running, whatever the outcome
                    os.kill(pid, signal.SIGKILL)
    finally:
        for pids in survivors.values():
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    assert survivors == {}, f"processes of a killed launch outlived it by {SURVIVAL_LIMIT_S:g} s: {survivors}"
