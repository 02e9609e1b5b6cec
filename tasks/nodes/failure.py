"""What the two ways of starting a segment's nodes share: the node queue name, the attempt name, and the failure.

`NodeFailed` is what a multi-node segment raises, whichever path ran it
(`tasks.nodes.local` or `tasks.nodes.work_pool`); its `failure` is the failing
node's diagnosis with the node named in the detail, so the segment task's
retry policy decides as for a single-node launch. A deployed node's diagnosis
comes back only as its flow run's state message: `failure_from_message` reads
it back from the headline `infra.launch.failures.Failure.headline` wrote.
"""

from __future__ import annotations

import dataclasses
import re
import time
import uuid

from infra.launch.failures import Failure, FailureClass

__all__ = ["NODE_QUEUE", "NodeFailed", "failure_from_message", "new_attempt", "node_failure"]

NODE_QUEUE = "node-{node_rank}"
"""The work queue node K's flow run goes to; start each node's worker with `--work-queue node-K`."""

_HEADLINE = re.compile(r"(\w+) failed(?: on rank (\d+))?: (\w+) \((.*?)\); ")


class NodeFailed(RuntimeError):
    """A node of a multi-node segment failed; `failure` is its diagnosis (`infra.launch.failures.Failure`), when known."""

    def __init__(self, message: str, failure=None, node_rank: int | None = None) -> None:
        super().__init__(message)
        self.failure = failure
        self.node_rank = node_rank


def new_attempt() -> str:
    """A fresh attempt name: each try of a segment rendezvouses under its own id."""
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"


def node_failure(failure: Failure | None, node_rank: int, nnodes: int) -> Failure | None:
    """The node's diagnosis, with the node named in its detail (the ledger's and the failure report's headline)."""
    if failure is None:
        return None
    return dataclasses.replace(failure, detail=f"node {node_rank} of {nnodes}: {failure.detail}")


def failure_from_message(message: str | None, stage: str = "segment") -> Failure | None:
    """The diagnosis a failed node run's state message carries (`infra.launch.failures.Failure.headline`), if any."""
    found = _HEADLINE.search(message or "")
    if found is None:
        return None
    try:
        cause = FailureClass(found[3])
    except ValueError:
        return None
    return Failure(stage=stage, cause=cause, rank=int(found[2]) if found[2] else None, detail=found[4])
