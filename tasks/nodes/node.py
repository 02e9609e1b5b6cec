"""One node's share of a multi-node segment: its torchrun launch, watched and logged like a single-node one.

Both ways of starting the nodes call `run_node`: the local fallback runs one
per node in the orchestrator (`tasks.nodes.local`), the work-pool path runs it
in the per-node flow (`flows.node`) on the worker of that node's queue. Each
node runs `nproc_per_node` ranks of trainer_core.run.segment_main, joined over
c10d rendezvous (`infra.launch.rendezvous`) at `train.rdzv_endpoint`, or, when
that is unset, at the endpoint node 0 published for this attempt
(`infra.launch.rendezvous_board`). The stall watchdog (`tasks.watchdog`) and
the launch's timeout end this node's torchrun and ranks, as does `stop` (a
sibling node failed). Each node keeps its ranks' logs in its own folder,
RUN_DIR/logs/segment-NNNN/ATTEMPT/node-K.

Where a node's files are (`NodeFiles`):

- `shared`: the local nodes use the run directory the segment task already
  filled from the store, and the segment task uploads the state;
- `own`: a work pool's node keeps its own copy under its `run.work_dir` (local
  to that machine): it fetches the plan, its shard and the previous state from
  the store (verified), and the node whose ranks hold global rank 0 (rank 0
  writes the state and the result) uploads the new state before its flow run
  succeeds. c10d hands out global ranks by sorting the nodes' addresses and
  pids, not by node rank, so that node is the one whose run directory holds
  the result this attempt wrote.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from infra.launch.launcher import LaunchResult, launch_or_raise
from infra.launch.ports import pick_free_port
from infra.launch.rendezvous import NodeRendezvous
from infra.launch.rendezvous_board import publish_endpoint, read_endpoint, withdraw_endpoint
from infra.store import open_store
from trainer_core.run.progress import progress_path
from trainer_core.run.segment_main import segment_result_path

from ..launch_logs import store_launch_logs
from ..outcomes import PlannedRun
from ..run_state import fetch_segment_inputs, publish_segment_state
from ..watchdog import SegmentWatch

__all__ = ["NodeFiles", "launch_node", "node_run_dir", "run_node"]

SEGMENT_MODULE = "trainer_core.run.segment_main"


def node_run_dir(planned: PlannedRun, work_dir: str | None = None) -> Path:
    """This node's run directory: `work_dir/RUN_ID` when the node's worker names its own work dir, else the run's."""
    return Path(work_dir).expanduser().resolve() / planned.run_id if work_dir else Path(planned.run_dir)


@dataclass(frozen=True)
class NodeFiles:
    """Where a node reads its inputs and writes the state, and whether it moves them through the store itself."""

    run_dir: Path
    own: bool
    """True: fetch the inputs from the store, and upload the state when this node held global rank 0."""

    def planned_here(self, planned: PlannedRun) -> PlannedRun:
        return planned.model_copy(update={"run_dir": str(self.run_dir)})


@contextlib.contextmanager
def rendezvous_endpoint(
    planned: PlannedRun, node_rank: int, rdzv_id: str, address: str, stop: Callable[[], str | None]
) -> Iterator[str]:
    """`train.rdzv_endpoint` when pinned; else node 0 publishes a free port on `address`, the others read it."""
    if planned.train.rdzv_endpoint is not None:
        yield planned.train.rdzv_endpoint
        return
    store = open_store(planned.storage)
    if node_rank != 0:
        yield read_endpoint(store, planned.run_id, rdzv_id, stop=stop)
        return
    endpoint = f"{address}:{pick_free_port(host=address)}"
    publish_endpoint(store, planned.run_id, rdzv_id, endpoint)
    try:
        yield endpoint
    finally:
        withdraw_endpoint(store, planned.run_id, rdzv_id)


def node_log_dir(run_dir: Path, segment_index: int, attempt_dir: str, node_rank: int) -> Path:
    return run_dir / "logs" / f"segment-{segment_index:04d}" / attempt_dir / f"node-{node_rank}"


def launch_node(
    planned: PlannedRun,
    segment_index: int,
    node: NodeRendezvous,
    on_line: Callable[[str], None],
    *,
    attempt_dir: str,
    run_dir: Path,
    stop: Callable[[], str | None] | None = None,
) -> LaunchResult:
    """Run this node's ranks of segment `segment_index`; raises LaunchError (with its diagnosis) on failure."""
    watch = SegmentWatch(progress_path(run_dir, segment_index), planned.train.stall_timeout_s)

    def monitor() -> str | None:
        return (stop() if stop is not None else None) or watch()

    return launch_or_raise(
        SEGMENT_MODULE,
        ["--run-dir", str(run_dir), "--segment", str(segment_index)],
        stage="segment",
        nproc_per_node=planned.train.nproc_per_node,
        timeout_s=planned.train.segment_timeout_s,
        on_line=on_line,
        monitor=monitor,
        log_dir=node_log_dir(run_dir, segment_index, attempt_dir, node.node_rank),
        node=node,
    )


def run_node(
    planned: PlannedRun,
    segment_index: int,
    node_rank: int,
    rdzv_id: str,
    on_line: Callable[[str], None],
    *,
    files: NodeFiles,
    attempt_dir: str,
    address: str = "127.0.0.1",
    stop: Callable[[], str | None] = lambda: None,
) -> LaunchResult:
    """Node `node_rank`'s whole share of the segment: inputs, rendezvous, launch and (`files.own`) the state upload."""
    here = files.planned_here(planned)
    result_path = segment_result_path(files.run_dir, segment_index)
    if files.own:
        fetch_segment_inputs(here, segment_index)
        # A result left by an earlier attempt on this node must not make it look like this attempt's rank 0.
        result_path.unlink(missing_ok=True)
    try:
        with rendezvous_endpoint(planned, node_rank, rdzv_id, address, stop) as endpoint:
            node = NodeRendezvous(planned.train.nnodes, node_rank, endpoint, rdzv_id)
            result = launch_node(
                planned, segment_index, node, on_line, attempt_dir=attempt_dir, run_dir=files.run_dir, stop=stop
            )
    finally:
        store_launch_logs(planned, files.run_dir, node_log_dir(files.run_dir, segment_index, attempt_dir, node_rank))
    if files.own and result_path.is_file():
        publish_segment_state(here, segment_index)  # this node held global rank 0
    return result
