"""Read back what a flow run left in the Prefect API: the flow run, its task runs, artifacts and events."""

from __future__ import annotations

import json
import time

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, FlowRunFilter
from prefect.client.schemas.sorting import FlowRunSort
from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter


def flow_runs_named(name: str) -> list:
    """Flow runs with this name, newest first."""
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name={"any_": [name]}), sort=FlowRunSort.START_TIME_DESC
        )


def task_runs_of(flow_run_id) -> list:
    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}), limit=200)


def artifacts_of(flow_run_id) -> dict[str, list]:
    """{key: [artifact, …]} of the artifacts a flow run (and its task runs) created."""
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id={"any_": [flow_run_id]}), limit=200)
    by_key: dict[str, list] = {}
    for artifact in found:
        by_key.setdefault(artifact.key, []).append(artifact)
    return by_key


def table_rows(artifact) -> list[dict]:
    return artifact.data if isinstance(artifact.data, list) else json.loads(artifact.data)


def run_events(run_id: str, expected: dict[str, int], timeout_s: float = 300.0) -> list:
    """The rankflow events of a run, waiting until at least `expected` {name: count} have arrived."""
    deadline = time.monotonic() + timeout_s
    while True:
        with get_client(sync_client=True) as client:
            page = client.read_events(
                EventFilter(
                    event=EventNameFilter(prefix=["rankflow."]),
                    resource=EventResourceFilter(id=[f"rankflow.run.{run_id}"]),
                ),
                limit=50,
            )
        counts = {name: sum(1 for e in page.events if e.event == name) for name in expected}
        if all(counts[name] >= n for name, n in expected.items()) or time.monotonic() > deadline:
            return page.events
        time.sleep(0.5)
