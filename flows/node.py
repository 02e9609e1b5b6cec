"""The per-node flow: node K's share of one multi-node segment, run by the worker of work queue `node-K`.

The segment stage of `rankflow-train` creates one run of this flow per node
(`tasks.nodes.work_pool`); each runs the node's torchrun (`tasks.nodes.node`),
which joins the others at the rendezvous endpoint and ends with them. A
failure fails this flow run, with the node's diagnosis as its message; the
segment stage then cancels the other nodes' runs (the worker kills their
processes, torchrun and ranks with them) and retries the segment. It is
deployed next to the training deployment (`flows.deploy.deploy_node_flow`).
"""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run

from infra.launch.rendezvous import NodeRendezvous
from tasks._logging import rank_line_logger
from tasks.nodes.node import launch_node
from tasks.outcomes import PlannedRun

__all__ = ["node_flow"]


def _node_run_name() -> str:
    parameters = flow_run.parameters
    planned = parameters["planned"]
    run_id = planned.run_id if isinstance(planned, PlannedRun) else planned["run_id"]
    return f"{run_id} segment-{parameters['segment_index']} node-{parameters['node_rank']}"


@flow(name="rankflow-node", flow_run_name=_node_run_name, log_prints=True)
def node_flow(planned: PlannedRun, segment_index: int, node_rank: int, rdzv_id: str, attempt: str) -> dict:
    """Run node `node_rank`'s ranks of segment `segment_index` (rendezvous `rdzv_id` at planned.train.rdzv_endpoint)."""
    if planned.train.rdzv_endpoint is None:
        raise ValueError("a deployed node needs train.rdzv_endpoint (node 0's HOST:PORT); set it in the run's config")
    node = NodeRendezvous(planned.train.nnodes, node_rank, planned.train.rdzv_endpoint, rdzv_id)
    result = launch_node(planned, segment_index, node, rank_line_logger(), attempt_dir=attempt)
    return {"node_rank": node_rank, "segment": segment_index, "launch_wall_s": result.wall_s}
