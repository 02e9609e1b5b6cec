"""The local path of a multi-node segment: one thread per node in this process, each running the node's torchrun.

For one machine and tests (`train.node_deployment` unset): every node runs
`tasks.nodes.node.run_node` in the run directory the segment task filled,
rendezvous at `train.rdzv_endpoint`, or at a free port of 127.0.0.1 that node
0 publishes through the store (as a work pool's nodes do). The first node to fail stops the
others through their launch monitor (`stop`), and the error raised names the
node whose failure caused the others'.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from infra.launch.failures import FailureClass, classify_exception

from ..outcomes import PlannedRun
from .failure import NodeFailed, node_failure
from .node import NodeFiles, run_node

__all__ = ["launch_local_nodes"]


def _first_cause(errors: dict[int, BaseException], aborted: set[int]) -> tuple[int, BaseException]:
    """The node whose failure caused the others': not one we stopped, and not a lost peer when another says more."""
    ranked = sorted(
        errors.items(),
        key=lambda item: (item[0] in aborted, classify_exception(item[1]) is FailureClass.COLLECTIVE_TIMEOUT),
    )
    return ranked[0]


def launch_local_nodes(
    planned: PlannedRun,
    segment_index: int,
    rdzv: str,
    attempt: str,
    on_line: Callable[[str], None],
    tick: Callable[[], object],
) -> None:
    failed = threading.Event()
    errors: dict[int, BaseException] = {}
    aborted: set[int] = set()
    lock = threading.Lock()

    def run(node_rank: int) -> None:
        def stop() -> str | None:
            if not failed.is_set():
                return None
            aborted.add(node_rank)
            return "another node of the segment failed"

        try:
            run_node(
                planned,
                segment_index,
                node_rank,
                rdzv,
                lambda line: on_line(f"[node {node_rank}] {line}"),
                files=NodeFiles(Path(planned.run_dir), own=False),
                attempt_dir=attempt,
                stop=stop,
            )
        except BaseException as error:  # noqa: BLE001 - every node's failure is reported by the caller
            with lock:
                errors[node_rank] = error
            failed.set()

    threads = [
        threading.Thread(target=run, args=(k,), name=f"node-{k}-segment-{segment_index}")
        for k in range(planned.train.nnodes)
    ]
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
        raise NodeFailed(
            f"node {node_rank} of {planned.train.nnodes} failed; nodes {others} were stopped with it\n{error}",
            node_failure(getattr(error, "failure", None), node_rank, planned.train.nnodes),
            node_rank,
        ) from error
