"""The work-pool path of a multi-node segment: one per-node flow run per node, waited for and failed together.

Each node's run of the per-node deployment (`flows.node`) is created with
`run_deployment(..., timeout=0)` on work queue `node-K` of the deployment's
pool and linked to the segment task as a subflow. The segment waits for all
of them; the first that ends other than Completed fails the segment: every
other run is cancelled (a scheduled one at once; a running one through the
worker, which kills its process, and torchrun and its ranks die with it) and
waited for, then `NodeFailed` is raised with the failed node's diagnosis,
read back from its state message (`tasks.nodes.failure`), so the segment's
retry policy decides as for a local launch. A node run still waiting for a
worker on a queue that no live worker polls (`tasks.nodes.queue_liveness`)
fails the attempt the same way, within a minute, naming the queue. When every
node run completed, the node that held global rank 0 has stored the state:
the segment's result is fetched from the store (verified) into the run
directory, the state itself is not.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from infra.launch.failures import Failure, FailureClass

from ..outcomes import PlannedRun
from ..run_state import stored_segment_result
from .failure import NODE_QUEUE, NodeFailed, failure_from_message, node_failure
from .queue_liveness import QUEUE_SILENCE_S, silent_queue_problem

__all__ = ["launch_deployed_nodes"]

POLL_S = 1.0
START_GRACE_S = 300.0
"""Time for the workers to pick the node runs up and start them, on top of train.segment_timeout_s."""
QUEUE_CHECK_S = 5.0
"""How often the queues of node runs no worker has picked up yet are checked for a live worker."""
CANCEL_WAIT_S = 90.0
"""How long a cancelled node run gets to end (the worker kills its processes) before the segment gives up waiting."""


def _start_node_runs(planned: PlannedRun, segment_index: int, rdzv: str, attempt: str) -> dict:
    from prefect.deployments import run_deployment

    deployment = planned.train.node_deployment
    assert deployment is not None  # the work-pool path is chosen only when it is set (tasks/nodes/__init__.py)
    runs = {}
    for node_rank in range(planned.train.nnodes):
        runs[node_rank] = run_deployment(
            deployment,
            timeout=0,
            work_queue_name=NODE_QUEUE.format(node_rank=node_rank),
            parameters={
                "planned": planned.model_dump(mode="json"),
                "segment_index": segment_index,
                "node_rank": node_rank,
                "rdzv_id": rdzv,
                "attempt": attempt,
            },
            tags=["rankflow", f"run:{planned.run_id}", f"segment:{segment_index}"],
        )
    return runs


def _cancel(client, runs: dict, reason: str) -> None:
    """Cancel every node run not yet over, and wait (bounded) until each has ended."""
    from prefect.states import Cancelled, Cancelling

    for run in runs.values():
        state = client.read_flow_run(run.id).state
        if state is None or state.is_final():
            continue
        # A run no worker has started has no process to kill; a started one is killed by its worker.
        new_state = Cancelled(message=reason) if state.is_scheduled() else Cancelling(message=reason)
        client.set_flow_run_state(run.id, new_state, force=True)
    deadline = time.monotonic() + CANCEL_WAIT_S
    while time.monotonic() < deadline:
        if all((s := client.read_flow_run(run.id).state) is not None and s.is_final() for run in runs.values()):
            return
        time.sleep(POLL_S)


def _unserved_node(client, pool: str, states: dict, silence_s: float) -> tuple[int, str] | None:
    """The first node whose run waits on a queue no live worker serves, with the reason."""
    for node_rank, state in sorted(states.items()):
        if state is not None and state.is_scheduled():
            problem = silent_queue_problem(client, pool, NODE_QUEUE.format(node_rank=node_rank), silence_s=silence_s)
            if problem is not None:
                return node_rank, problem
    return None


def _fetch_result(planned: PlannedRun, segment_index: int) -> None:
    if stored_segment_result(planned, segment_index) is None:
        raise NodeFailed(
            f"every node run of segment {segment_index} completed, but its state is not complete in the store "
            "(the node holding global rank 0 uploads it before succeeding)",
            Failure("segment", FailureClass.STORAGE_OUTAGE, None, "the nodes' state is missing from the store"),
        )


def launch_deployed_nodes(
    planned: PlannedRun,
    segment_index: int,
    rdzv: str,
    attempt: str,
    tick: Callable[[], object],
    *,
    queue_silence_s: float = QUEUE_SILENCE_S,
) -> None:
    """Run the segment's node flow runs; a queue still unpolled `queue_silence_s` after they were created fails it."""
    from prefect.client.orchestration import get_client

    runs: dict = {}
    with get_client(sync_client=True) as client:
        try:
            runs = _start_node_runs(planned, segment_index, rdzv, attempt)
            deployment = planned.train.node_deployment
            assert deployment is not None  # the work-pool path is chosen only when it is set
            pool = client.read_deployment_by_name(deployment).work_pool_name
            deadline = time.monotonic() + planned.train.segment_timeout_s + START_GRACE_S
            # A queue just made for these runs has not been polled yet: a worker serving it polls within seconds.
            next_queue_check = time.monotonic() + queue_silence_s
            while True:
                states = {k: client.read_flow_run(run.id).state for k, run in runs.items()}
                ended = {k: s for k, s in states.items() if s is not None and s.is_final() and not s.is_completed()}
                if ended:
                    node_rank, state = sorted(ended.items())[0]
                    reason = f"node {node_rank} of segment {segment_index} ended {state.name}"
                    _cancel(client, runs, reason)
                    runs = {}  # all ended: nothing left to cancel on the way out
                    raise NodeFailed(
                        f"{reason}: {state.message}",
                        node_failure(failure_from_message(state.message), node_rank, planned.train.nnodes),
                        node_rank,
                    )
                if all(s is not None and s.is_completed() for s in states.values()):
                    _fetch_result(planned, segment_index)
                    return
                if pool is not None and time.monotonic() >= next_queue_check:
                    next_queue_check = time.monotonic() + QUEUE_CHECK_S
                    if (unserved := _unserved_node(client, pool, states, queue_silence_s)) is not None:
                        node_rank, problem = unserved
                        _cancel(client, runs, problem)
                        runs = {}
                        raise NodeFailed(
                            f"node {node_rank} of segment {segment_index} cannot start: {problem}",
                            Failure("segment", FailureClass.LAUNCH_TIMEOUT, None, problem),
                            node_rank,
                        )
                if time.monotonic() > deadline:
                    raise NodeFailed(
                        f"the node runs of segment {segment_index} did not finish within "
                        f"train.segment_timeout_s + {START_GRACE_S:g} s",
                        Failure(
                            "segment",
                            FailureClass.LAUNCH_TIMEOUT,
                            None,
                            f"node runs never finished within train.segment_timeout_s + {START_GRACE_S:g} s: raise "
                            "train.segment_timeout_s in the config, or with --set train.segment_timeout_s=SECONDS",
                        ),
                    )
                tick()
                time.sleep(POLL_S)
        except BaseException:
            if runs:
                _cancel(client, runs, f"segment {segment_index} failed")
            raise
