"""Multi-node pieces without processes: torchrun's rendezvous arguments, the child environment, diagnoses read back."""

from __future__ import annotations

import pytest

from infra.launch.failures import Failure, FailureClass
from infra.launch.launcher import LaunchError, _child_env, torchrun_command
from infra.launch.rendezvous import STORE_HOST_ENV, NodeRendezvous, rendezvous_id
from tasks.nodes.failure import NodeFailed, failure_from_message, node_failure
from tasks.nodes.local import _first_cause
from trainer_core.node_topology import check_nodes, split_endpoint
from trainer_core.run.process_boot import BOOT_SCRIPT


def test_node_zero_hosts_the_rendezvous_and_the_others_join_it(tmp_path):
    rdzv = rendezvous_id("run-0123456789ab", 3, "A1")
    assert rdzv == "run-0123456789ab-segment-0003-attempt-A1"
    commands = [
        torchrun_command("m", ["--x"], 2, tmp_path, NodeRendezvous(2, k, "127.0.0.1:29400", rdzv)) for k in (0, 1)
    ]
    for node_rank, command in enumerate(commands):
        assert "--nnodes=2" in command and "--nproc-per-node=2" in command and "--max-restarts=0" in command
        assert "--rdzv-backend=c10d" in command and "--rdzv-endpoint=127.0.0.1:29400" in command
        assert f"--rdzv-id={rdzv}" in command and "--local-addr=127.0.0.1" in command
        assert f"--rdzv-conf=is_host={int(node_rank == 0)},join_timeout=300" in command
        # Each rank runs the module through the boot script that arms its death signal first (trainer_core.run.process_boot).
        assert command[command.index(str(BOOT_SCRIPT), 3) :] == [str(BOOT_SCRIPT), "m", "--x"]
    single = torchrun_command("m", [], 2, tmp_path)
    assert "--nnodes=1" in single and "--rdzv-endpoint=127.0.0.1:0" in single


def test_a_loopback_node_keeps_collectives_on_lo_and_a_remote_one_serves_its_store_at_the_endpoint(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv(STORE_HOST_ENV, raising=False)
    loopback = _child_env(None, 1, tmp_path, NodeRendezvous(2, 0, "127.0.0.1:29400", "r"))
    assert loopback["GLOO_SOCKET_IFNAME"] == "lo" and STORE_HOST_ENV not in loopback
    remote_node = NodeRendezvous(2, 1, "10.1.2.3:29400", "r")
    remote = _child_env(None, 1, tmp_path, remote_node)
    assert "GLOO_SOCKET_IFNAME" not in remote and remote[STORE_HOST_ENV] == "10.1.2.3"
    assert "--local-addr=127.0.0.1" not in remote_node.torchrun_args()


@pytest.mark.parametrize("endpoint", ["node0", "host:", ":29400", "host:0", "host:70000", "ho st:1", "-x:1"])
def test_a_bad_endpoint_names_the_fix(endpoint):
    with pytest.raises(ValueError, match="is not HOST:PORT; write node 0's address and a free port"):
        split_endpoint(endpoint)


def test_world_size_over_nodes_must_divide_logical_dp():
    check_nodes(2, 2, 8, None, None)
    with pytest.raises(ValueError, match=r"2 × 3 = 6; choose a logical_dp that 6 divides \(e\.g\. 6\)"):
        check_nodes(2, 3, 8, None, None)
    with pytest.raises(ValueError, match="is not FLOW/DEPLOYMENT"):
        check_nodes(2, 1, 2, "rankflow-node", "127.0.0.1:1")


def test_a_failed_node_runs_diagnosis_is_read_back_from_its_state_message():
    failure = Failure("segment", FailureClass.RANK_DIED, 1, "killed by SIGKILL: the kernel's OOM killer or an operator")
    message = f"Flow run encountered an exception: LaunchError: {failure.headline()}\nmore lines"
    read_back = failure_from_message(message)
    assert read_back == failure and read_back.retriable
    code_error = Failure("segment", FailureClass.CODE_ERROR, None, "TypeError: x")
    assert failure_from_message(code_error.headline()) == code_error and not code_error.retriable
    assert failure_from_message("Flow run was cancelled.") is None and failure_from_message(None) is None
    named = node_failure(failure, 1, 2)
    assert named.cause is FailureClass.RANK_DIED and named.detail.startswith("node 1 of 2: killed by SIGKILL")


def _launch_error(cause: FailureClass) -> LaunchError:
    return LaunchError("x", result=None, failure=Failure("segment", cause, 0, "d"))


def test_the_node_that_caused_the_failure_is_named_not_the_ones_it_took_down():
    died, lost_peer, stopped = (
        _launch_error(FailureClass.RANK_DIED),
        _launch_error(FailureClass.COLLECTIVE_TIMEOUT),
        _launch_error(FailureClass.RANK_STALLED),
    )
    assert _first_cause({0: lost_peer, 1: died}, aborted=set()) == (1, died)
    assert _first_cause({0: stopped, 1: lost_peer}, aborted={0}) == (1, lost_peer)
    assert NodeFailed("m", node_failure(died.failure, 1, 2), 1).failure.cause is FailureClass.RANK_DIED
