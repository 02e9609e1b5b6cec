"""One node's part of a multi-node torchrun launch: its c10d rendezvous arguments.

Every node runs `torchrun --nnodes N --rdzv-backend=c10d --rdzv-endpoint
HOST:PORT --rdzv-id ID --max-restarts=0`; c10d hands out the node ranks (and
so the global ranks) as nodes join, which changes no result: logical ranks
make the weights independent of which process runs which. Node 0 serves the
rendezvous store on HOST:PORT (`is_host=1`; it must run on HOST), the others
connect to it (`is_host=0`): stated explicitly rather than guessed from the
hostname, since on one machine every node's hostname matches. The id names
the run, the segment and the attempt, so a straggler of a failed attempt can
never join the retry's rendezvous. The store of a loopback endpoint listens on
127.0.0.1 only (`infra.launch.loopback_torchrun`), and so does collective traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer_core.node_topology import split_endpoint

__all__ = ["LOOPBACK_HOSTS", "NodeRendezvous", "STORE_HOST_ENV", "rendezvous_id"]

STORE_HOST_ENV = "RANKFLOW_STORE_HOST"
"""The address torchrun's store servers listen on instead of 127.0.0.1 (`infra.launch.loopback_torchrun`): a multi-node
endpoint's host, set by the launcher."""

LOOPBACK_HOSTS = ("127.0.0.1", "localhost")
JOIN_TIMEOUT_S = 300
"""How long a node waits for the others at the rendezvous (torchrun's default is 600 s)."""


def rendezvous_id(run_id: str, segment_index: int, attempt: str) -> str:
    return f"{run_id}-segment-{segment_index:04d}-attempt-{attempt}"


@dataclass(frozen=True)
class NodeRendezvous:
    nnodes: int
    node_rank: int
    endpoint: str
    """HOST:PORT of node 0's rendezvous store."""
    rdzv_id: str
    join_timeout_s: float = JOIN_TIMEOUT_S

    def __post_init__(self) -> None:
        split_endpoint(self.endpoint)
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node rank {self.node_rank} is outside nnodes={self.nnodes}")

    @property
    def host(self) -> str:
        return split_endpoint(self.endpoint)[0]

    @property
    def is_loopback(self) -> bool:
        return self.host in LOOPBACK_HOSTS

    def torchrun_args(self) -> list[str]:
        args = [
            f"--nnodes={self.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.rdzv_id}",
            f"--rdzv-conf=is_host={int(self.node_rank == 0)},join_timeout={int(self.join_timeout_s)}",
        ]
        if self.is_loopback:
            args.append("--local-addr=127.0.0.1")
        return args
