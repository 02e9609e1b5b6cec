"""One node's share of a multi-node segment: its torchrun launch, watched and logged like a single-node one.

Both ways of starting the nodes call `launch_node`: the local fallback runs
one per node in the orchestrator (`tasks.nodes.local`), the work-pool path runs it
in the per-node flow (`flows.node`) on the worker of that node's queue. Each
node runs `nproc_per_node` ranks of trainer_core.run.segment_main, joined over
c10d rendezvous (`infra.launch.rendezvous`); the stall watchdog (`tasks.watchdog`)
and the launch's timeout end this node's torchrun and ranks, as does `stop`
(a sibling node failed). Each node keeps its ranks' logs in its own folder,
RUN_DIR/logs/segment-NNNN/ATTEMPT/node-K.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from infra.launch.launcher import LaunchResult, launch_or_raise
from infra.launch.rendezvous import NodeRendezvous
from trainer_core.run.progress import progress_path

from ..outcomes import PlannedRun
from ..watchdog import SegmentWatch

__all__ = ["launch_node", "node_run_dir"]

SEGMENT_MODULE = "trainer_core.run.segment_main"


def node_run_dir(planned: PlannedRun, segment_index: int) -> Path:
    """Where a node reads the plan, its shards and the previous segment's state, and where rank 0 saves the next.

    The one input of a node launch. Today it is the run directory itself, so
    the nodes share it (one machine, or a shared filesystem at the same path);
    fetching these from the store into an empty work dir belongs here.
    """
    return Path(planned.run_dir)


def launch_node(
    planned: PlannedRun,
    segment_index: int,
    node: NodeRendezvous,
    on_line: Callable[[str], None],
    *,
    attempt_dir: str,
    stop: Callable[[], str | None] | None = None,
) -> LaunchResult:
    """Run this node's ranks of segment `segment_index`; raises LaunchError (with its diagnosis) on failure."""
    run_dir = node_run_dir(planned, segment_index)
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
        log_dir=run_dir / "logs" / f"segment-{segment_index:04d}" / attempt_dir / f"node-{node.node_rank}",
        node=node,
    )
