"""Multi-node segments on one machine, through `rankflow run` (the local fallback: one torchrun per node).

Real processes, rendezvous on 127.0.0.1: a segment on 2 nodes × 1 process
commits bitwise the weights (and losses) of 1 node × 2 processes at the same
train.logical_dp; a node whose rank is killed mid-segment stops every node
(each pid of that attempt gone before the retry starts one process) and the
retry resumes to the same result. One 2-node run serves both: its first
segment trains undisturbed, its second is killed once and retried.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import threading
import time
from pathlib import Path

import psutil
import pytest

from flows.cli import main
from infra.runs import ledger
from tests.conftest import EXAMPLES
from tests.e2e.flows.test_logical_ranks_flow import committed_weights_sha256
from tests.processes import descendants, pid_alive
from trainer_core.run.faults import FAULT_ENV, FAULT_KIND_ENV

pytestmark = [pytest.mark.flow, pytest.mark.distributed]

_ATTEMPT = re.compile(r"--rdzv-id=(\S+)")


@pytest.fixture(scope="module")
def one_node_two_processes(tmp_path_factory, prefect_harness) -> dict:
    base = tmp_path_factory.mktemp("one-node")
    return _run_capturing(base, "train.nproc_per_node=2", "train.nnodes=1")


def _run_capturing(base: Path, *settings: str) -> dict:
    """The main job, 2 steps in 2 segments at logical_dp = 2, with its own work dir and store under `base`.

    The summary is read from the CLI's stdout (a module-scoped fixture has no capsys).
    """
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(
            [
                "run",
                str(EXAMPLES / "tiny_sft.toml"),
                "--set",
                "train.logical_dp=2",
                "--set",
                "train.steps=2",
                "--set",
                "train.warmup_steps=1",  # the example's 5 would outlast the run: refused
                "--set",
                "train.steps_per_segment=1",
                "--set",
                f"run.work_dir={base / 'work'}",
                "--set",
                f"storage.url={base / 'store'}",
                *[item for s in settings for item in ("--set", s)],
            ]
        )
    summary = json.loads(out.getvalue().strip().splitlines()[-1])
    assert code == 0 and summary["status"] == "completed", summary
    summary["weights_sha256"] = committed_weights_sha256(str(base / "store"), summary["run_id"], base / "download")
    return summary


def _same_result(a: dict, b: dict) -> None:
    assert (a["run_id"], a["losses"], a["weights_sha256"]) == (b["run_id"], b["losses"], b["weights_sha256"])


def test_two_nodes_of_one_process_equal_one_node_of_two_bitwise(one_node_two_processes, two_nodes):
    run_dir = two_nodes["base"] / "work" / two_nodes["summary"]["run_id"]
    assert len(two_nodes["summary"]["losses"]) == 2
    _same_result(two_nodes["summary"], one_node_two_processes)
    entries = ledger.read(run_dir)
    assert [e["segment"] for e in entries if e["stage"] == "segment" and e["status"] == "completed"] == [0, 1]
    # Each node kept its own rank logs, one folder per node of each segment's attempt (segment 1 had two).
    for segment, attempts in ((0, 1), (1, 2)):
        node_logs = sorted(p.name for p in (run_dir / "logs" / f"segment-{segment:04d}").glob("*/node-*"))
        assert node_logs == sorted(["node-0", "node-1"] * attempts), (segment, node_logs)


class AttemptSampler:
    """Samples this process's descendants: which torchrun and rank processes belong to which attempt (rdzv id)."""

    def __init__(self) -> None:
        self.pids: dict[str, set[int]] = {}
        self.order: list[str] = []
        self.overlaps: list[str] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _attempt_of(self, pid: int) -> str | None:
        try:
            process = psutil.Process(pid)
            cmdline = " ".join(process.cmdline())
            if "infra.launch.loopback_torchrun" in cmdline and (found := _ATTEMPT.search(cmdline)):
                return found[1]
            return process.environ().get("TORCHELASTIC_RUN_ID")
        except psutil.Error:  # exited while we looked, or not ours to read
            return None

    def _run(self) -> None:
        while not self._done.wait(0.05):
            for pid in descendants(os.getpid()):
                attempt = self._attempt_of(pid)
                if attempt is None or "segment-0001" not in attempt:
                    continue
                if attempt not in self.pids:
                    # A new attempt starts: every process of the earlier ones must be gone by now.
                    alive = [p for a in self.order for p in self.pids[a] if pid_alive(p)]
                    if alive:
                        self.overlaps.append(f"{attempt} started while {alive} of an earlier attempt lived")
                    self.pids[attempt] = set()
                    self.order.append(attempt)
                self.pids[attempt].add(pid)

    def __enter__(self) -> "AttemptSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=10)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, prefect_harness) -> dict:
    """The same job on 2 nodes × 1 process; rank 1 is SIGKILLed (as the OOM killer would) once, at step 1."""
    base = tmp_path_factory.mktemp("two-nodes")
    marker = base / "fault-happened"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FAULT_ENV, f"1:1:{marker}")  # rank 1 (node 1's only rank... or node 0's: c10d decides)
        patch.setenv(FAULT_KIND_ENV, "kill")
        started = time.monotonic()
        with AttemptSampler() as sampler:
            summary = _run_capturing(base, "train.nproc_per_node=1", "train.nnodes=2")
        elapsed_s = time.monotonic() - started
    return {"base": base, "marker": marker, "sampler": sampler, "summary": summary, "elapsed_s": elapsed_s}


def test_a_killed_node_stops_every_node_and_the_retry_resumes_to_the_same_result(one_node_two_processes, two_nodes):
    sampler, resumed = two_nodes["sampler"], two_nodes["summary"]
    assert two_nodes["marker"].is_file()
    assert len(sampler.order) == 2, sampler.order  # the failed attempt and its retry, each under its own rdzv id
    failed_attempt = sampler.pids[sampler.order[0]]
    assert len(failed_attempt) >= 4, failed_attempt  # two torchruns and their ranks: both nodes were running
    assert sampler.overlaps == []  # every node's processes were gone before the retry started
    assert [p for pids in sampler.pids.values() for p in pids if pid_alive(p)] == []
    entries = ledger.read(two_nodes["base"] / "work" / resumed["run_id"])
    failures = [e for e in entries if e["stage"] == "segment" and e["status"] == "failed"]
    assert len(failures) == 1 and failures[0]["segment"] == 1, failures
    assert failures[0]["failure"]["cause"] == "rank_died" and failures[0]["failure"]["rank"] == 1, failures[0]
    assert re.search(r"rank_died \(node [01] of 2: killed by SIGKILL", failures[0]["error"]), failures[0]["error"]
    trained = [e["segment"] for e in entries if e["stage"] == "segment" and e["status"] == "completed"]
    assert trained == [0, 1]  # segment 0 was not trained again: the retry resumed from its state
    _same_result(resumed, one_node_two_processes)
    assert two_nodes["elapsed_s"] < 600
