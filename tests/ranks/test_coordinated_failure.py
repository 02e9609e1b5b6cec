"""An exception on one rank, in any command of either facade, stops every rank at once, naming the rank.

The collective timeout of these launches is above the launch's own timeout: a rank that waited for it instead of
hearing of the failure keeps its launch running until the launch is killed, and the test fails on that cause (the
launch's exit or `timed_out`), whatever the machine's load.
"""

from __future__ import annotations

import re

import pytest

from infra.launch.failures import FailureClass, diagnose_launch
from infra.launch.launcher import launch
from tests.ranks.failure_worker import RANK_ZERO_COMMANDS
from tests.trainer.ranks import ROOT

pytestmark = pytest.mark.distributed

CASES = (
    [f"rank-zero {c}" for c in RANK_ZERO_COMMANDS]
    + [
        "rank-zero step on rank 0",
        "rank-zero forward inside the trainer",
        "rank-zero backward inside the trainer",
        "rank-zero step inside the trainer",
        "rank-zero callback",
        "rank-zero interrupt on rank 1",
        "rank-zero interrupt on rank 0",
        "rank-zero driver",
    ]
    + [f"logical-dp {c}" for c in ("forward", "backward", "step", "save", "logical rank", "interrupt")]
)


def test_each_command_failing_on_one_rank_fails_every_rank_promptly_with_the_rank_named():
    lines: list[str] = []
    result = launch(
        "tests.ranks.failure_worker",
        [],
        nproc_per_node=4,
        timeout_s=400,
        env={"PYTHONPATH": str(ROOT)},
        on_line=lines.append,
    )
    assert result.returncode == 0, "\n".join(lines[-60:])
    done = {}
    for line in lines:
        found = re.search(r"OK rank (\d) (.+) ([\d.]+)s$", line)
        if found:
            done[(int(found[1]), found[2])] = float(found[3])
    missing = [(rank, case) for rank in range(4) for case in CASES if (rank, case) not in done]
    assert not missing, missing


@pytest.mark.parametrize("command", ["forward", "step", "export"])
def test_an_uncaught_failure_on_rank_1_ends_the_launch_in_seconds_and_rank_0_names_it(command):
    lines: list[str] = []
    result = launch(
        "tests.ranks.failure_worker",
        ["--exit-on", command],
        nproc_per_node=2,
        timeout_s=300,
        env={"PYTHONPATH": str(ROOT)},
        on_line=lines.append,
    )
    assert result.returncode != 0 and not result.timed_out
    (record,) = result.error_records  # only the failing rank records an error; rank 0 stopped because of it
    assert record["rank"] == 1 and record["type"] == "InjectedFault"
    expected = (
        f"[rank 0] ERROR RankFailure: {command} failed on rank 1 "
        f"(rank 1: InjectedFault: injected fault in {command} on rank 1"
    )
    assert any(line.startswith(expected) for line in lines), "\n".join(lines[-40:])
    failure = diagnose_launch(result, "segment")
    assert failure.rank == 1 and failure.cause is FailureClass.TRANSIENT


@pytest.mark.parametrize("where", ["call", "logical_rank"])
def test_a_keyboard_interrupt_on_rank_1_stops_its_peers_with_a_rank_failure_naming_it(where):
    """Ctrl-C (a real SIGINT) on one rank is reported like any failure: the peers learn it, then it is re-raised."""
    lines: list[str] = []
    result = launch(
        "tests.ranks.failure_worker",
        ["--interrupt-in", where],
        nproc_per_node=2,
        timeout_s=300,
        env={"PYTHONPATH": str(ROOT)},
        on_line=lines.append,
    )
    assert result.returncode != 0 and not result.timed_out
    (record,) = result.error_records  # rank 0 stopped because of rank 1: a RankFailure, not recorded
    assert record["rank"] == 1 and record["type"] == "KeyboardInterrupt", record
    assert "every rank stopped" in record["traceback"], record["traceback"]  # re-raised after the exchange
    command = "call" if where == "call" else "the logical ranks' work of step 0"
    expected = f"[rank 0] ERROR RankFailure: {command} failed on rank 1 (rank 1: KeyboardInterrupt"
    assert any(line.startswith(expected) for line in lines), "\n".join(lines[-40:])
