"""A run lease lost while local nodes train stops every node before the error leaves the segment stage."""

from __future__ import annotations

import threading
import time

import pytest

import tasks.nodes as nodes
from infra.runs.run_lease import RunLeaseLost
from tasks.outcomes import PlannedRun
from trainer_core.config import StorageSection, TrainSection


def _planned(tmp_path) -> PlannedRun:
    train = TrainSection(
        nproc_per_node=1, nnodes=2, logical_dp=2, segment_timeout_s=60, rdzv_endpoint="127.0.0.1:29999"
    )
    return PlannedRun(
        run_id="run-0123456789ab",
        digest="d",
        run_dir=str(tmp_path),
        segment_steps=[(0, 2)],
        train=train,
        storage=StorageSection(url=str(tmp_path)),
    )


def test_a_lost_lease_stops_every_local_node_and_nothing_is_reported(tmp_path, monkeypatch):
    stopped: dict[int, str] = {}
    running = threading.Barrier(2)
    both_running = threading.Event()

    def fake_launch_node(planned, segment_index, node, on_line, *, attempt_dir, run_dir, stop):
        # Stands in for a node's torchrun: it runs until the launcher's monitor (stop) says why it must end.
        running.wait(timeout=300)
        both_running.set()
        deadline = time.monotonic() + 300
        while (reason := stop()) is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"node {node.node_rank} was never told to stop")
            time.sleep(0.01)
        stopped[node.node_rank] = reason
        raise RuntimeError(f"node {node.node_rank} stopped: {reason}")

    reported = []
    monkeypatch.setattr(nodes.node, "launch_node", fake_launch_node)
    monkeypatch.setattr(nodes, "report_failure", lambda *args, **kwargs: reported.append(args))

    def tick() -> None:
        if not both_running.is_set():
            return  # the lease is lost once both nodes train
        raise RunLeaseLost("run lease taken over by gpu-node-9:4242")

    with pytest.raises(RunLeaseLost, match="gpu-node-9"):
        nodes.launch_segment_nodes(_planned(tmp_path), 0, lambda line: None, tick)
    # Both nodes were told to stop and had ended when the error came out; the ledger is another run's now.
    assert sorted(stopped) == [0, 1] and set(stopped.values()) == {"another node of the segment failed"}
    assert not [t for t in threading.enumerate() if t.name.startswith("node-")]
    assert reported == []
