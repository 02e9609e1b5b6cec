"""Which failures a task retries: the failure class decides (`infra.failures`).

Bad data or config, code errors and in-rank out-of-memory errors would fail the
same way again, so they end the task at once; a dead, stalled or preempted
rank, a collective timeout or a storage outage is retried from the last saved
state, up to the task's `retries`.
"""

from __future__ import annotations

from prefect.client.schemas.objects import TaskRun
from prefect.states import State

from infra.failures import classify_exception


def retry_if_retriable(task, task_run: TaskRun, state: State) -> bool:
    """Prefect's `retry_condition_fn`: retry unless the failure's class says a retry cannot help."""
    error = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    if not isinstance(error, BaseException):
        return True
    return classify_exception(error).retriable
