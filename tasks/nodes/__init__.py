"""A segment on several nodes: start one node launch per node, wait for all, and fail them together.

With `train.nnodes` > 1 the segment stage hands its launch to `launch_nodes`:

- `train.node_deployment` set (the work-pool path): one flow run of the
  per-node deployment (`flows.node`, `rankflow-node/NAME`) per node, created
  with `run_deployment(..., timeout=0)` on work queue `node-K` of the
  deployment's pool, so the worker serving that queue runs node K. Each node
  fetches its inputs from the store into its own work dir and the node holding
  global rank 0 uploads the new state (`tasks.nodes.node`), so the segment
  task neither fetches nor uploads (`nodes_move_their_files`); a node queue no
  live worker serves fails the attempt within a minute.
- unset (the local fallback, for one machine and tests): one thread per node
  in this process, each running the node's torchrun (`tasks.nodes.node`) in
  the run directory.

Either way node 0 serves the rendezvous at `train.rdzv_endpoint` when it is
set, else at a free port it publishes through the store for the attempt
(`infra.launch.rendezvous_board`).

Any node's failure is the segment's failure: the other nodes' launches are
ended at once (their torchrun and ranks killed; deployed ones cancelled, and
the worker kills the flow run's process, which takes its torchrun and ranks
with it), never left waiting for a collective or rendezvous timeout, and the
error raised carries the failing node's diagnosis, so the segment task's
retry policy decides as for one node and a retry resumes from the last state.

This package's modules: `failure` (what both paths share), `node` (one node's
launch), `local` and `work_pool` (the two paths). Only this `__init__` chooses
between them; nothing here imports it back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from infra.launch.rendezvous import rendezvous_id
from infra.runs.run_lease import RunLeaseLost

from ..failure_report import report_failure
from ..outcomes import PlannedRun
from .failure import NodeFailed, new_attempt
from .local import launch_local_nodes
from .work_pool import launch_deployed_nodes

__all__ = ["NodeFailed", "launch_nodes", "launch_segment_nodes", "new_attempt", "nodes_move_their_files"]


def nodes_move_their_files(planned: PlannedRun) -> bool:
    """True when the segment's nodes fetch its inputs and upload its state themselves (a work pool's node runs)."""
    return planned.train.nnodes > 1 and planned.train.node_deployment is not None


def launch_nodes(
    planned: PlannedRun, segment_index: int, on_line: Callable[[str], None], tick: Callable[[], object] = lambda: None
) -> float:
    """Run segment `segment_index` on `planned.train.nnodes` nodes; returns the wall time; raises NodeFailed.

    `tick` is called about every half second in the calling thread while the nodes run (the live view).
    """
    attempt = new_attempt()
    rdzv = rendezvous_id(planned.run_id, segment_index, attempt)
    started = time.perf_counter()
    if planned.train.node_deployment is None:
        launch_local_nodes(planned, segment_index, rdzv, attempt, on_line, tick)
    else:
        launch_deployed_nodes(planned, segment_index, rdzv, attempt, tick)
    return time.perf_counter() - started


def launch_segment_nodes(
    planned: PlannedRun, segment_index: int, on_line: Callable[[str], None], watch: Callable[[], str | None]
) -> float:
    """The segment stage's multi-node launch; a failure is reported once for the segment (ledger, artifact).

    `watch` only feeds the live view here: each node's own watchdog ends a stalled node.
    """
    try:
        return launch_nodes(planned, segment_index, on_line, tick=watch)
    except RunLeaseLost:
        raise  # the run is another's now: its ledger is not ours to write
    except Exception as error:
        report_failure(Path(planned.run_dir), planned.run_id, "segment", error, segment=segment_index)
        raise
