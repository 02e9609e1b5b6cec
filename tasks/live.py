"""The run's live view in the Prefect UI: a progress artifact and a metrics table, updated while a segment trains.

The flow creates both artifacts once (so they belong to the flow run); each
segment task updates them in place from the progress records its watchdog
reads (`tasks.watchdog`), at most once a second: progress is the steps done of
the run's total, the table shows the newest steps with loss, gradient norm,
learning rate and tokens/s, then the objective's own figures (its
`live_columns`: for the clipped policy gradient the stale trajectories
dropped, the clipped fraction and the mean importance ratio).

Every artifact of a run is kept by key, one per flow run (`upsert_*`): an
artifact the flow run already has under that key is updated in place, so a
flow run started again (Retry in the UI re-runs the same flow run) still
shows one progress, one metrics table, one failure report.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import cast
from uuid import UUID

from prefect import get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
from prefect.client.schemas.sorting import ArtifactSort
from prefect.context import TaskRunContext, get_run_context
from prefect.exceptions import MissingContextError
from pydantic import BaseModel

from trainer_core.objectives import OBJECTIVES, LiveColumn

METRIC_ROWS = 20
"""Newest steps shown in the metrics table."""


def artifact_key(run_id: str, what: str) -> str:
    # Artifact keys allow lowercase letters, digits and dashes only.
    return "".join(c if c.isalnum() else "-" for c in f"{run_id}-{what}".lower())


def in_prefect_run() -> bool:
    """Whether a flow or task run is active (artifacts and events need one; `task.fn()` calls have none)."""
    try:
        get_run_context()
    except MissingContextError:
        return False
    return True


class LiveArtifacts(BaseModel):
    """Ids of the flow run's live artifacts, handed to each segment task."""

    run_id: str
    progress_id: UUID
    metrics_id: UUID
    total_steps: int


def flow_run_artifact(key: str):
    """This flow run's newest artifact under `key` (a prefect Artifact), if it has one (a flow run started again has)."""
    from prefect.runtime import flow_run

    flow_run_id = flow_run.get_id()
    if flow_run_id is None:
        return None
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(str(flow_run_id))])
            ),
            sort=ArtifactSort.CREATED_DESC,
            limit=1,
        )
    return found[0] if found else None


def _update(artifact_id: UUID, data, description: str) -> UUID:
    with get_client(sync_client=True) as client:
        client.update_artifact(artifact_id, ArtifactUpdate(data=data, description=description))
    return artifact_id


# Prefect's async_dispatch types these calls as `UUID | Coroutine`: called outside an event loop, as here, they
# return the UUID.
def upsert_progress_artifact(key: str, progress: float, description: str) -> UUID:
    existing = flow_run_artifact(key)
    if existing is not None:
        return cast(UUID, update_progress_artifact(existing.id, progress, description=description))
    return cast(UUID, create_progress_artifact(progress=progress, key=key, description=description))


def upsert_table_artifact(key: str, table: list[dict], description: str) -> UUID:
    existing = flow_run_artifact(key)
    if existing is not None:
        return _update(existing.id, json.dumps(table), description)
    return cast(UUID, create_table_artifact(table=table, key=key, description=description))


def artifact_url(location: str) -> str:
    """A location as a URL an artifact's link can hold: a store's own URL (`s3://…`) as it is, a local path as a
    `file://` URL (percent-encoded: a path with a space or a `#` is no URL as it stands)."""
    if "://" in location:
        return location
    return Path(location).absolute().as_uri()


def artifact_link(location: str) -> str:
    """A markdown link to `location` whose text is its URL (`artifact_url`)."""
    url = artifact_url(location)
    return f"[{url}]({url})"


def upsert_markdown_artifact(key: str, markdown: str, description: str) -> UUID:
    existing = flow_run_artifact(key)
    if existing is not None:
        return _update(existing.id, markdown, description)
    return cast(UUID, create_markdown_artifact(markdown=markdown, key=key, description=description))


def create_live_artifacts(run_id: str, total_steps: int, steps_done: int) -> LiveArtifacts:
    progress_id = upsert_progress_artifact(
        artifact_key(run_id, "progress"),
        100.0 * steps_done / total_steps,
        f"Run {run_id}: {steps_done} of {total_steps} optimizer steps done",
    )
    metrics_id = upsert_table_artifact(
        artifact_key(run_id, "metrics"),
        [{"step": None, "loss": None}],
        f"Run {run_id}: live step metrics (waiting for the first step)",
    )
    return LiveArtifacts(run_id=run_id, progress_id=progress_id, metrics_id=metrics_id, total_steps=total_steps)


def _figure(value, digits: int):
    if isinstance(value, float):
        return round(value, digits) if math.isfinite(value) else str(value)  # NaN/inf are not JSON numbers
    return value


def metrics_row(record: dict, columns: tuple[LiveColumn, ...] = ()) -> dict:
    """One table row: the loop's figures, then the objective's `columns`."""
    row = {
        "step": record["step"],
        "loss": _figure(record["loss"], 4),
        "grad_norm": _figure(record["grad_norm"], 4),
        "learning_rate": f"{record['learning_rate']:.3g}",
        "tokens_per_s": _figure(record["tokens_per_s"], 0),
        "step_s": _figure(record["step_s"], 3),
        "updated": record["stepped"],
    }
    row.update({column.column: _figure(record[column.figure], column.digits) for column in columns})
    if record.get("eval_loss") is not None:  # only the steps after which the held-out rows were evaluated
        row["eval_loss"] = _figure(record["eval_loss"], 4)
    return row


def live_columns(ready: dict) -> tuple[LiveColumn, ...]:
    """The objective's columns, named by the segment's `ready` record (none from a launch that names none)."""
    objective = OBJECTIVES.get(ready.get("objective", ""))
    return objective.live_columns if objective is not None else ()


class LivePublisher:
    """Receives a segment's progress records and updates the live artifacts (throttled)."""

    def __init__(self, live: LiveArtifacts, segment_index: int, min_interval_s: float = 1.0) -> None:
        self._live = live
        self._segment_index = segment_index
        self._min_interval_s = min_interval_s
        self._rows: list[dict] = []
        self._last_update = -math.inf
        self._steps_done: int | None = None
        self._pending = False
        self._columns: tuple[LiveColumn, ...] = ()

    def __call__(self, records: list[dict]) -> None:
        for record in records:
            if record["event"] == "step":
                self._rows.append(metrics_row(record, self._columns))
                self._steps_done = record["step"] + 1
            elif record["event"] == "ready":
                self._columns = live_columns(record)
                if self._steps_done is None:
                    self._steps_done = record["start_step"]
            self._pending = True
        if self._pending and time.monotonic() - self._last_update >= self._min_interval_s:
            self.flush()

    def flush(self) -> None:
        if self._steps_done is None:
            return
        self._pending = False
        self._last_update = time.monotonic()
        try:
            self._update()
        except Exception as error:  # noqa: BLE001 - a hiccup of the Prefect API must not end the training launch
            self._pending = True  # try again at the next poll
            get_run_logger().warning(f"live artifacts not updated this time: {type(error).__name__}: {error}")

    def _update(self) -> None:
        total, steps_done = self._live.total_steps, self._steps_done
        assert steps_done is not None  # `flush` updates nothing before the first record
        where = f"segment {self._segment_index}: {steps_done} of {total} optimizer steps done"
        update_progress_artifact(
            self._live.progress_id, 100.0 * steps_done / total, description=f"Run {self._live.run_id}, {where}"
        )
        if self._rows:
            newest = list(reversed(self._rows[-METRIC_ROWS:]))
            with get_client(sync_client=True) as client:
                client.update_artifact(
                    self._live.metrics_id,
                    ArtifactUpdate(
                        data=json.dumps(newest), description=f"Run {self._live.run_id}, {where} (newest first)"
                    ),
                )


def publisher_for(live: LiveArtifacts | None, segment_index: int) -> LivePublisher | None:
    """A publisher when there is something to publish to (a live view and a task run)."""
    if live is None or not isinstance(TaskRunContext.get(), TaskRunContext):
        return None
    return LivePublisher(live, segment_index)


def show_steps_done(live: LiveArtifacts, steps_done: int) -> None:
    """Move the progress artifact after a segment (a reused one included: its steps are done too)."""
    update_progress_artifact(
        live.progress_id,
        100.0 * steps_done / live.total_steps,
        description=f"Run {live.run_id}: {steps_done} of {live.total_steps} optimizer steps done",
    )
