"""Several nodes per segment: the config checks, and what the plan digest leaves out.

A segment on `train.nnodes` nodes runs `nproc_per_node` processes on each, a
world of nnodes × nproc_per_node ranks that must divide `train.logical_dp`
(each rank runs logical_dp / world logical ranks, so results do not depend on
how the ranks are spread over nodes; `trainer_core.ranks`). The checks run in
the config's validation, so a bad topology is refused with exit 2 before
anything starts.
"""

from __future__ import annotations

import re

__all__ = ["NODE_KEYS", "check_nodes", "split_endpoint", "world_size"]

_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]*$")

NODE_KEYS = ("nnodes", "rdzv_endpoint", "node_deployment")
"""train.* keys that say where a segment runs, not what it computes (left out of the plan digest)."""


def world_size(nnodes: int, nproc_per_node: int) -> int:
    return nnodes * nproc_per_node


def check_nodes(
    nnodes: int, nproc_per_node: int, logical_dp: int, node_deployment: str | None, rdzv_endpoint: str | None
) -> None:
    """Raise ValueError naming the fix unless the nodes' world size divides logical_dp and the node settings are well formed."""
    # Imported here: trainer_core.ranks loads torch, and this module is imported by light processes
    # (the loopback torchrun agent, `rankflow deploy`) that only need split_endpoint.
    from .ranks.topology import topology_problem

    world = world_size(nnodes, nproc_per_node)
    if problem := topology_problem(world, logical_dp):  # the world rule only: the batch is checked by the config
        raise ValueError(
            f"train.logical_dp={logical_dp} is not a multiple of the world size train.nnodes × train.nproc_per_node = "
            f"{nnodes} × {nproc_per_node} = {world}; choose a logical_dp that {world} divides "
            f"(e.g. {problem.suggestion}), or fewer nodes or processes"
        )
    if rdzv_endpoint is not None:
        split_endpoint(rdzv_endpoint)
    if node_deployment is not None and (node_deployment.count("/") != 1 or "" in node_deployment.split("/")):
        raise ValueError(
            f"train.node_deployment={node_deployment!r} is not FLOW/DEPLOYMENT; write it as "
            '"rankflow-node/NAME" (what `rankflow deploy` prints as node_deployment)'
        )


def split_endpoint(rdzv_endpoint: str) -> tuple[str, int]:
    """(host, port) of a `HOST:PORT` rendezvous endpoint; ValueError naming the fix otherwise."""
    host, sep, port = rdzv_endpoint.rpartition(":")
    if not sep or not _HOST.match(host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"train.rdzv_endpoint={rdzv_endpoint!r} is not HOST:PORT; write node 0's address and a free "
            'port on it, e.g. "10.0.0.5:29400" (or "127.0.0.1:29400" on one machine)'
        )
    return host, int(port)
