"""`rankflow run` as a user runs it: a failed run is one clean line, and the command ends right after its last line;
Ctrl-C mid-segment is one line, the result line and exit 130, and the same command then resumes the run.

One real `rankflow` process (console script, its own temporary Prefect
server, a torchrun launch of two gloo ranks) on a tiny config whose segment
fails on rank 1 with a code error (not retried). The references are the
process itself — its exit status, what it printed, when it exited, and what a
child subreaper (tests/cli/watch_exit.py) finds still running after it — and
the run's own ledger and log files. The interrupted run (its own tiny
config) gets SIGINT at its process group, as a terminal's Ctrl-C sends it,
while a rank hangs inside its second segment.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import psutil
import pytest

from tests.cli.watched_run import started_rankflow_run, watched_rankflow_run
from tests.conftest import tiny_tree
from tests.e2e.run_lease.runs import wait_for
from tests.processes import descendants, pid_alive
from trainer_core.run.faults import FAULT_ENV, FAULT_KIND_ENV

# Prefect's own stop of its temporary server waits 5 s: an exit that took that wait is at least 5 s after the
# last line. The bound sits below it, with room for a loaded machine (it was 2 s).
EXIT_WITHIN_S = 4.0

pytestmark = [pytest.mark.flow, pytest.mark.distributed]  # `rankflow run`: a Prefect flow over torchrun


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("failed-run")
    tree = tiny_tree(root, train={"steps": 2, "steps_per_segment": 2, "global_batch_size": 4})
    # rank 1 raises a TypeError at step 1: a retry would fail the same way
    env = {FAULT_ENV: f"1:1:{root / 'fault-happened'}", FAULT_KIND_ENV: "code"}
    return {"root": root, "tree": tree, **watched_rankflow_run(root, tree, env)}


def test_a_failed_run_prints_one_clean_line_naming_stage_rank_and_retries(failed_run):
    assert failed_run["returncode"] == 1, failed_run["stderr"][-3000:]
    stderr = failed_run["stderr"]
    assert "Traceback" not in stderr and not re.search(r'^\s*File "', stderr, re.MULTILINE), stderr[-4000:]
    ours = [line for line in stderr.splitlines() if line.startswith("rankflow: ")]
    assert len(ours) == 1 and stderr.rstrip("\n").splitlines()[-1] == ours[0], stderr[-3000:]
    line = ours[0]
    assert line.startswith("rankflow: run failed: segment failed on rank 1: code_error (TypeError: injected fault"), (
        line
    )
    assert "attempt 1 of 3, not retried: a retry cannot help (code_error); fix the cause" in line, line
    log_file = Path(re.search(r"full error and traceback: (\S+)\)$", line)[1])
    assert log_file.is_file() and "Traceback (most recent call last)" in log_file.read_text()  # kept, just not shown

    summary = json.loads(failed_run["stdout"].strip().splitlines()[-1])
    assert (summary["status"], summary["failed_stage"], summary["failed_rank"], summary["failure_cause"]) == (
        "failed",
        "segment",
        1,
        "code_error",
    )
    run_dir = Path(failed_run["tree"]["run"]["work_dir"]) / summary["run_id"]
    assert summary["failure_log"] == str(log_file) and log_file.is_relative_to(run_dir / "logs" / "failures")
    failed = [json.loads(entry) for entry in (run_dir / "ledger.jsonl").read_text().splitlines() if '"failed"' in entry]
    assert [(e["stage"], e["failure"]["rank"], e["failure"]["attempt"], e["failure"]["retried"]) for e in failed] == [
        ("segment", 1, 1, False)
    ]


def test_the_command_exits_right_after_its_last_line_and_leaves_no_process(failed_run):
    assert failed_run["exit_after_last_stdout_s"] is not None
    assert failed_run["exit_after_last_stdout_s"] <= EXIT_WITHIN_S, failed_run["exit_after_last_stdout_s"]
    assert failed_run["left_behind"] == []  # not the temporary Prefect server, not a rank, not torchrun


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:  # exited since it was listed
        return ""


@pytest.fixture(scope="module")
def interrupted_then_resumed(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("interrupted-run")
    tree = tiny_tree(root, train={"steps": 4, "steps_per_segment": 2, "global_batch_size": 4})
    hung = root / "rank-0-hangs"
    env = {FAULT_ENV: f"3:0:{hung}", FAULT_KIND_ENV: "hang"}  # once: inside the second segment, at step 3
    process = started_rankflow_run(root, tree, env, root / "interrupted")
    try:
        wait_for(lambda: hung.exists() or process.poll() is not None, 600, "the second segment never started")
        assert process.poll() is None, (root / "interrupted.err").read_text()[-3000:]
        family = descendants(process.pid)  # torchrun, its ranks, the temporary Prefect server
        servers = [(pid, os.getsid(pid)) for pid in family if "server.api.server:create_app" in _cmdline(pid)]
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C at the terminal
        returncode = process.wait(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    wait_for(lambda: not any(pid_alive(pid) for pid in family), 60, f"processes of {family} outlived the command")
    interrupted = {
        "returncode": returncode,
        "stdout": (root / "interrupted.out").read_text(),
        "stderr": (root / "interrupted.err").read_text(),
        "servers": servers,
    }
    return {"root": root, "tree": tree, "interrupted": interrupted, "rerun": watched_rankflow_run(root, tree, env)}


def test_ctrl_c_mid_segment_is_one_line_a_result_line_and_exit_130(interrupted_then_resumed):
    interrupted = interrupted_then_resumed["interrupted"]
    stderr = interrupted["stderr"]
    assert interrupted["returncode"] == 130, stderr[-3000:]  # not killed by SIGINT (-2): the command's own exit
    assert "Traceback" not in stderr and not re.search(r'^\s*File "', stderr, re.MULTILINE), stderr[-4000:]
    ours = [line for line in stderr.splitlines() if line.startswith("rankflow: ")]
    assert len(ours) == 1 and stderr.rstrip("\n").splitlines()[-1] == ours[0], stderr[-3000:]
    assert ours[0].startswith("rankflow: interrupted (Ctrl-C)") and "run the same command again" in ours[0]
    summary = json.loads(interrupted["stdout"].strip().splitlines()[-1])
    assert summary["status"] == "interrupted" and summary["checkpoint_url"] is None
    # What the run did before the Ctrl-C: its id, and the first segment's two steps (the second hung at step 3).
    assert summary["run_id"] and (summary["steps"], len(summary["losses"])) == (2, 2), summary
    # The temporary server was started by the command, tied to it (tests/cli/test_temporary_server.py), in a
    # session of its own: the terminal's Ctrl-C reached the command alone, which then stopped the server.
    [(server, session)] = interrupted["servers"]
    assert session == server


def test_the_same_command_resumes_an_interrupted_run(interrupted_then_resumed):
    rerun = interrupted_then_resumed["rerun"]
    assert rerun["returncode"] == 0, rerun["stderr"][-3000:]
    summary = json.loads(rerun["stdout"].strip().splitlines()[-1])
    assert (summary["status"], summary["steps"], len(summary["losses"])) == ("completed", 4, 4)
    assert (summary["segments_reused"], summary["segments_trained"]) == (1, 1)  # the first segment was not redone
    assert rerun["left_behind"] == []
