"""A segment on several nodes: start one node launch per node, wait for all, and fail them together.

With `train.nnodes` > 1 the segment stage hands its launch to `launch_nodes`:

- `train.node_deployment` set (the work-pool path): one flow run of the
  per-node deployment (`flows.node`, `rankflow-node/NAME`) per node, created
  with `run_deployment(..., timeout=0)` on work queue `node-K` of the
  deployment's pool, so the worker serving that queue runs node K; node 0
  serves the rendezvous at `train.rdzv_endpoint` and must run on its host.
- unset (the local fallback, for one machine and tests): one thread per node
  in this process, each running the node's torchrun (`tasks.node_launch`),
  rendezvous on 127.0.0.1 and `train.rdzv_endpoint`'s port, or a free one.

Any node's failure is the segment's failure: the other nodes' launches are
ended at once (their torchrun and ranks killed; deployed ones cancelled, and
the worker kills the flow run's process, which takes its torchrun and ranks
with it), never left waiting for a collective or rendezvous timeout, and the
error raised carries the failing node's diagnosis, so the segment task's
retry policy decides as for one node and a retry resumes from the last state.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from infra.failures import Failure, FailureClass, classify_exception
from infra.local_process import pick_free_port
from infra.rendezvous import NodeRendezvous, rendezvous_id
from infra.run_lease import RunLeaseLost

from .node_launch import launch_node
from .outcomes import PlannedRun

__all__ = ["NodeFailed", "launch_nodes", "launch_segment_nodes", "new_attempt"]

NODE_QUEUE = "node-{node_rank}"
"""The work queue node K's flow run goes to; start each node's worker with `--work-queue node-K`."""


class NodeFailed(RuntimeError):
    """A node of a multi-node segment failed; `failure` is its diagnosis (`infra.failures.Failure`), when known."""

    def __init__(self, message: str, failure=None, node_rank: int | None = None) -> None:
        super().__init__(message)
        self.failure = failure
        self.node_rank = node_rank


def new_attempt() -> str:
    """A fresh attempt name: each try of a segment rendezvouses under its own id."""
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"


def endpoint_for(planned: PlannedRun) -> str:
    return planned.rdzv_endpoint or f"127.0.0.1:{pick_free_port()}"


def launch_nodes(planned: PlannedRun, segment_index: int, on_line: Callable[[str], None],
                 tick: Callable[[], object] = lambda: None) -> float:
    """Run segment `segment_index` on `planned.nnodes` nodes; returns the wall time; raises NodeFailed.

    `tick` is called about every half second in the calling thread while the nodes run (the live view).
    """
    attempt = new_attempt()
    rdzv = rendezvous_id(planned.run_id, segment_index, attempt)
    started = time.perf_counter()
    if planned.node_deployment is None:
        _launch_local_nodes(planned, segment_index, endpoint_for(planned), rdzv, attempt, on_line, tick)
    else:
        from .deployed_nodes import launch_deployed_nodes

        launch_deployed_nodes(planned, segment_index, rdzv, attempt, tick)
    return time.perf_counter() - started


def _first_cause(errors: dict[int, BaseException], aborted: set[int]) -> tuple[int, BaseException]:
    """The node whose failure caused the others': not one we stopped, and not a lost peer when another says more."""
    ranked = sorted(errors.items(), key=lambda item: (item[0] in aborted,
                                                        classify_exception(item[1]) is FailureClass.COLLECTIVE_TIMEOUT))
    return ranked[0]


def _launch_local_nodes(planned: PlannedRun, segment_index: int, endpoint: str, rdzv: str, attempt: str,
                        on_line: Callable[[str], None], tick: Callable[[], object]) -> None:
    failed = threading.Event()
    errors: dict[int, BaseException] = {}
    aborted: set[int] = set()
    lock = threading.Lock()

    def run(node_rank: int) -> None:
        node = NodeRendezvous(planned.nnodes, node_rank, endpoint, rdzv)

        def stop() -> str | None:
            if not failed.is_set():
                return None
            aborted.add(node_rank)
            return "another node of the segment failed"

        try:
            launch_node(planned, segment_index, node, lambda line: on_line(f"[node {node_rank}] {line}"),
                        attempt_dir=attempt, stop=stop)
        except BaseException as error:  # noqa: BLE001 - every node's failure is reported by the caller
            with lock:
                errors[node_rank] = error
            failed.set()

    threads = [threading.Thread(target=run, args=(k,), name=f"node-{k}-segment-{segment_index}")
               for k in range(planned.nnodes)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=0.5)
                tick()
    except BaseException:
        # The caller's tick ended the segment (a lost run lease): stop every node before raising.
        failed.set()
        for thread in threads:
            thread.join()
        raise
    if errors:
        node_rank, error = _first_cause(errors, aborted)
        others = sorted(set(errors) - {node_rank})
        raise NodeFailed(f"node {node_rank} of {planned.nnodes} failed; nodes {others} were stopped with it\n{error}",
                         node_failure(getattr(error, "failure", None), node_rank, planned.nnodes), node_rank) from error


def node_failure(failure: Failure | None, node_rank: int, nnodes: int) -> Failure | None:
    """The node's diagnosis, with the node named in its detail (the ledger's and the failure report's headline)."""
    if failure is None:
        return None
    return dataclasses.replace(failure, detail=f"node {node_rank} of {nnodes}: {failure.detail}")


def launch_segment_nodes(planned: PlannedRun, segment_index: int, on_line: Callable[[str], None],
                         watch: Callable[[], str | None]) -> float:
    """The segment stage's multi-node launch; a failure is reported once for the segment (ledger, artifact).

    `watch` only feeds the live view here: each node's own watchdog ends a stalled node.
    """
    from .failure_report import report_failure

    try:
        return launch_nodes(planned, segment_index, on_line, tick=watch)
    except RunLeaseLost:
        raise  # the run is another's now: its ledger is not ours to write
    except Exception as error:
        report_failure(Path(planned.run_dir), planned.run_id, "segment", error, segment=segment_index)
        raise
