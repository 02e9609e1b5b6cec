"""The per-node flow: node K's share of one multi-node segment, run by the worker of work queue `node-K`.

The segment stage of `rankflow-train` creates one run of this flow per node
(`tasks.nodes.work_pool`); each fetches the node's inputs from the store into
its own work dir, runs the node's torchrun (`tasks.nodes.node`), which joins
the others at the rendezvous endpoint and ends with them, and, on the node that
held global rank 0, uploads the new state before succeeding. A failure fails
this flow run, with the node's diagnosis as its message; the segment stage
then cancels the other nodes' runs (the worker kills their processes, torchrun
and ranks with them) and retries the segment. It is deployed next to the
training deployment (`flows.deploy.deploy_node_flow`).

The node's worker may say, in its environment, where this machine keeps the
run (`RANKFLOW_NODE_WORK_DIR`, default the config's `run.work_dir`) and the
address the other nodes reach it at when it is node 0 and `train.rdzv_endpoint`
is unset (`RANKFLOW_NODE_ADDRESS`, default its fully qualified host name).
"""

from __future__ import annotations

import os
import socket

from prefect import flow
from prefect.runtime import flow_run

from tasks._logging import rank_line_logger
from tasks.nodes.node import NodeFiles, node_run_dir, run_node
from tasks.outcomes import PlannedRun

__all__ = ["NODE_ADDRESS_ENV", "NODE_WORK_DIR_ENV", "node_flow"]

NODE_WORK_DIR_ENV = "RANKFLOW_NODE_WORK_DIR"
"""This machine's work dir for the node runs of its worker (the run's files go under it, in RUN_ID/)."""
NODE_ADDRESS_ENV = "RANKFLOW_NODE_ADDRESS"
"""The address node 0 serves the rendezvous at when train.rdzv_endpoint is unset."""


def _node_run_name() -> str:
    parameters = flow_run.parameters
    planned = parameters["planned"]
    run_id = planned.run_id if isinstance(planned, PlannedRun) else planned["run_id"]
    return f"{run_id} segment-{parameters['segment_index']} node-{parameters['node_rank']}"


@flow(name="rankflow-node", flow_run_name=_node_run_name, log_prints=True)
def node_flow(planned: PlannedRun, segment_index: int, node_rank: int, rdzv_id: str, attempt: str) -> dict:
    """Run node `node_rank`'s ranks of segment `segment_index` (rendezvous `rdzv_id`), its inputs from the store."""
    files = NodeFiles(node_run_dir(planned, os.environ.get(NODE_WORK_DIR_ENV)), own=True)
    address = os.environ.get(NODE_ADDRESS_ENV) or socket.getfqdn()
    result = run_node(
        planned,
        segment_index,
        node_rank,
        rdzv_id,
        rank_line_logger(),
        files=files,
        attempt_dir=attempt,
        address=address,
    )
    return {"node_rank": node_rank, "segment": segment_index, "launch_wall_s": result.wall_s}
