"""How rank 0 sends a command to every rank and hears back: one scatter out, one gather in.

Each command travels with a payload per rank (the rows of that rank's logical
ranks, the cotangents of its graphs) in one `scatter_object_list`; every
rank's `(status, result)` comes back in one `gather_object`. Only rank 0
learns the outcome; a failure reaches the others with the next command
(`abort`), which they are already waiting for. Both collectives carry the
process group's timeout (`train.collective_timeout_s`).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .topology import Topology

CLOSE = "close"
"""The driver finished: every rank returns from its command loop."""
ABORT = "abort"
"""A command (or the driver) failed: every rank raises, naming the failing rank."""


def send_command(command, payloads: list[Any], topology: Topology) -> Any:
    """On rank 0: give rank w `(command, payloads[w])`; returns rank 0's own payload."""
    if topology.world_size == 1:
        return payloads[0]
    received: list = [None]
    dist.scatter_object_list(received, [(command, payload) for payload in payloads], src=0)
    return received[0][1]


def receive_command(topology: Topology) -> tuple[Any, Any]:
    """On another rank: wait for rank 0's next `(command, payload)`."""
    received: list = [None]
    dist.scatter_object_list(received, None, src=0)
    return received[0]


def gather_outcomes(outcome: tuple[str | None, Any], topology: Topology) -> list[tuple[str | None, Any]] | None:
    """Every rank's `(status, result)`, by rank, on rank 0 (None elsewhere)."""
    if topology.world_size == 1:
        return [outcome]
    gathered: list | None = [None] * topology.world_size if topology.rank == 0 else None
    dist.gather_object(outcome, gathered, dst=0)
    return gathered
