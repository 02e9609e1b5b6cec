"""Prefect events a run emits, for automations (alerts, follow-up runs).

| event                          | when                                    | payload                                        |
|--------------------------------|-----------------------------------------|------------------------------------------------|
| rankflow.segment.completed     | a segment trained its steps             | run_id, segment, step, loss, tokens_per_s, url |
| rankflow.checkpoint.committed  | a checkpoint's manifest is in the store | run_id, step, loss, url (the checkpoint)       |
| rankflow.run.failed            | the flow run failed                     | run_id, stage, cause, rank, step, loss, url, error |

The resource is the run (`prefect.resource.id = rankflow.run.RUN_ID`) with
labels an automation can match without reading payloads: `rankflow.run-id`,
`rankflow.loss-finite` (`true`/`false`) and, for failures, `rankflow.cause`.
`url` is the flow run's page when the UI's address is known, else the
checkpoint or store location. The README has an example automation.
"""

from __future__ import annotations

import math

from prefect.events import emit_event
from prefect.runtime import flow_run

SEGMENT_COMPLETED = "rankflow.segment.completed"
CHECKPOINT_COMMITTED = "rankflow.checkpoint.committed"
RUN_FAILED = "rankflow.run.failed"


def flow_run_url() -> str | None:
    """The current flow run's page in the UI (None without a UI address or a flow run)."""
    from prefect.settings import PREFECT_UI_URL

    if flow_run.get_id() is None or not PREFECT_UI_URL.value():
        return None
    return flow_run.get_flow_run_ui_url()


def emit_run_event(
    name: str, run_id: str, *, loss: float | None = None, labels: dict[str, str] | None = None, **payload
):
    resource = {
        "prefect.resource.id": f"rankflow.run.{run_id}",
        "prefect.resource.name": run_id,
        "rankflow.run-id": run_id,
    }
    if loss is not None:
        resource["rankflow.loss-finite"] = str(math.isfinite(loss)).lower()
    resource.update(labels or {})
    figures = {"run_id": run_id, "loss": loss if loss is None or math.isfinite(loss) else str(loss), **payload}
    return emit_event(event=name, resource=resource, payload=figures)
