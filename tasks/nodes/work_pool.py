"""The work-pool path of a multi-node segment: one per-node flow run per node, waited for and failed together.

Each node's run of the per-node deployment (`flows.node`) is created with
`run_deployment(..., timeout=0)` on work queue `node-K` of the deployment's
pool and linked to the segment task as a subflow. The segment waits for all
of them; the first that ends other than Completed fails the segment: every
other run is cancelled (a scheduled one at once; a running one through the
worker, which kills its process, and torchrun and its ranks die with it) and
waited for, then `NodeFailed` is raised with the failed node's diagnosis,
read back from its state message (`tasks.nodes.failure`), so the segment's
retry policy decides as for a local launch.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from infra.launch.failures import Failure, FailureClass

from ..outcomes import PlannedRun
from .failure import NODE_QUEUE, NodeFailed, failure_from_message, node_failure

__all__ = ["launch_deployed_nodes"]

POLL_S = 1.0
START_GRACE_S = 300.0
"""Time for the workers to pick the node runs up and start them, on top of train.segment_timeout_s."""
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


def launch_deployed_nodes(
    planned: PlannedRun, segment_index: int, rdzv: str, attempt: str, tick: Callable[[], object]
) -> None:
    from prefect.client.orchestration import get_client

    runs: dict = {}
    with get_client(sync_client=True) as client:
        try:
            runs = _start_node_runs(planned, segment_index, rdzv, attempt)
            deadline = time.monotonic() + planned.train.segment_timeout_s + START_GRACE_S
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
                    return
                if time.monotonic() > deadline:
                    raise NodeFailed(
                        f"the node runs of segment {segment_index} did not finish within "
                        f"train.segment_timeout_s + {START_GRACE_S:g} s; are workers serving every "
                        f"node-K queue of the pool?",
                        Failure("segment", FailureClass.LAUNCH_TIMEOUT, None, "node runs never finished"),
                    )
                tick()
                time.sleep(POLL_S)
        except BaseException:
            if runs:
                _cancel(client, runs, f"segment {segment_index} failed")
            raise
