"""Which failures a task retries: the failure class decides (`infra.launch.failures`).

Bad data or config, code errors and in-rank out-of-memory errors would fail the
same way again, so they end the task at once; a dead, stalled or preempted
rank, a collective timeout or a storage outage is retried from the last saved
state, up to the task's `retries`. A stage fenced off by the run lease
(another run of the run id took it over) is never retried: the new holder
resumes the work, nor is a full disk (it stays full; the report says which
one), even by the publication stages that retry everything else. A stage
whose finalizer lease alone was taken over (a gc, a stale takeover while this
run still holds its run lease) is retried: the next try takes the finalizer
again.
"""

from __future__ import annotations

from prefect.client.schemas.objects import State, TaskRun

from infra.launch.failures import FailureClass, classify_exception
from infra.runs.run_lease import RunAlreadyActive, RunLeaseLost

# Another run of the run id owns the work now: a retry would only be fenced again.
_FENCED = (RunLeaseLost, RunAlreadyActive)


def retry_if_retriable(task, task_run: TaskRun, state: State) -> bool:
    """Prefect's `retry_condition_fn`: retry unless the failure's class says a retry cannot help."""
    error = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    if not isinstance(error, BaseException):
        return True
    if isinstance(error, _FENCED):
        return False  # another holder owns it: a retry would only be fenced again
    return classify_exception(error).retriable


def retry_unless_fenced(task, task_run: TaskRun, state: State) -> bool:
    """For publication stages, which retry every failure: every one but a lost run lease or a full disk."""
    error = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    if isinstance(error, _FENCED):
        return False
    return not (isinstance(error, BaseException) and classify_exception(error) is FailureClass.NO_SPACE)


def retry_unless_final(task, task_run: TaskRun, state: State) -> bool:
    """For the commit and cleanup stages: retry unless fenced off or the failure would recur.

    A refused manifest, a forbidden transition or a code error fail the same
    way on every try, so they end the stage at once; a storage outage, a
    timeout or a lost finalizer lease (the next try takes it again) are retried.
    """
    error = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    if not isinstance(error, BaseException):
        return True
    if isinstance(error, _FENCED):
        return False
    return classify_exception(error).retriable  # a lost finalizer lease alone is finalizer_lost: retried
