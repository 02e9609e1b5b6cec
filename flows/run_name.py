"""Rename the running flow run, in the API and in its log lines.

The flow run starts as `NAME (planning)`: its run id comes from the plan's
digest. Prefect names a run once, when it starts; renaming it later in the
API leaves the running engine and every logger made so far with the old
name, so each console line of the run (the engine's own "Finished in state"
included) would still say "(planning)". Here the run context's flow run
takes the new name (loggers made from then on use it), and a filter on
Prefect's run loggers stamps each record of a renamed flow run with its new
name, whichever logger made it: the engine logs its last lines outside the
run context, with a logger made when the run began.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext

_RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


class _RenamedFlowRuns(logging.Filter):
    """Gives each record of a renamed flow run that run's new name."""

    _MAX_RUNS = 256
    """Renames remembered: a long-lived process (`rankflow serve`) forgets the oldest, long finished."""

    def __init__(self) -> None:
        super().__init__()
        self._names: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def rename(self, flow_run_id: str, name: str) -> None:
        with self._lock:
            self._names[flow_run_id] = name
            self._names.move_to_end(flow_run_id)
            while len(self._names) > self._MAX_RUNS:
                self._names.popitem(last=False)

    def filter(self, record: logging.LogRecord) -> bool:
        name = self._names.get(getattr(record, "flow_run_id", None) or "")
        if name is not None and hasattr(record, "flow_run_name"):
            record.flow_run_name = name
        return True


_RENAMED = _RenamedFlowRuns()
"""One filter for the process, installed on Prefect's run loggers at the first rename."""


def rename_flow_run(name: str) -> None:
    """Give the flow run in context `name`, in the API and in its log lines from now on; outside a flow run, nothing."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return
    with get_client(sync_client=True) as client:
        client.update_flow_run(context.flow_run.id, name=name)
    context.flow_run.name = name  # the engine's own FlowRun object: loggers made from now on read it
    _RENAMED.rename(str(context.flow_run.id), name)
    for logger_name in _RUN_LOGGERS:
        logging.getLogger(logger_name).addFilter(_RENAMED)  # once: addFilter ignores a filter already there
