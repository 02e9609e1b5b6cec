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

A storage outage is ridden out inside the attempt first: object stores have
minute-long brownouts (resets, 503s), which Prefect's few short retries of a
stage (seconds apart) would not outlast. `rides_out_outages` runs a stage's
function again with a growing pause (2, 4, 8, … capped at 60 s) until the
outage has lasted `OutageBackoff.budget_s` (5 minutes); only then does the
outage fail the attempt, and Prefect's retries follow as for any failure. The
stage functions are idempotent (a retry resumes from what the store and the
run directory hold), so running one again is what a Prefect retry does too. A
launch's fence rides it out without stopping the launch (`tasks.fencing`). A
refusal (HTTP 403, a PermissionError) is no outage: it would be refused again.
Nor is a failed launch, whatever its ranks died of (an OSError in a rank may be
its local disk): it ends the attempt at once, for Prefect's retries, which are
recorded in the ledger and the failure report.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

from prefect.client.schemas.objects import State, TaskRun

from infra.launch.failures import Failure, FailureClass, classify_exception
from infra.launch.launcher import LaunchError
from infra.runs.run_lease import RunAlreadyActive, RunLeaseLost

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class OutageBackoff:
    """How long, and at what pace, a stage tries again through a storage outage before the outage fails it."""

    budget_s: float = 300.0
    """Seconds of outage (from its first failure) a stage rides out before it fails."""
    first_delay_s: float = 2.0
    """The first pause; each next one doubles."""
    max_delay_s: float = 60.0
    """The longest pause: a store back after a long outage is seen within this."""
    new_outage_after_s: float = 60.0
    """A failed try that ran this long, with a lease check of its own answered, failed in a new outage."""
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic

    def delays(self) -> Iterator[float]:
        """The pauses between tries: first_delay_s, doubling, capped at max_delay_s, without end."""
        delay = self.first_delay_s
        while True:
            yield delay
            delay = min(delay * 2, self.max_delay_s)


OUTAGE_BACKOFF = OutageBackoff()
"""What every stage rides out: 5 minutes of outage."""


RIDDEN_OUT_S = "_rankflow_outage_ridden_out_s"
"""Attribute of an outage error that was ridden out already (a launch's fence): for how long, so it is not again."""


def ridden_out(error: BaseException, lasted_s: float) -> None:
    """Mark `error` as an outage that lasted `lasted_s` while it was ridden out (`ride_out_outage` goes on from it)."""
    try:
        setattr(error, RIDDEN_OUT_S, lasted_s)
    except AttributeError:  # an exception type without a __dict__: it is ridden out again, no worse than that
        pass


_answers = threading.local()


def store_answered() -> None:
    """Note that the store answered a request of this thread's stage (`tasks.fencing.fence`: its lease was read)."""
    _answers.count = answers_so_far() + 1


def answers_so_far() -> int:
    """How many times the store answered this thread's stage (`store_answered`): a change means it answered."""
    return getattr(_answers, "count", 0)


def is_launch_failure(error: BaseException) -> bool:
    """Whether `error` is a failed launch (`LaunchError`, a node's `NodeFailed`): its ranks' diagnosis, not the store's."""
    return isinstance(error, LaunchError) or isinstance(getattr(error, "failure", None), Failure)


def is_storage_outage(error: BaseException) -> bool:
    """Whether `error` is object storage unreachable or failing (a retry later can succeed), not a refusal."""
    return classify_exception(error) is FailureClass.STORAGE_OUTAGE and not isinstance(error, PermissionError)


def outage_warning(what: str, error: BaseException, delay_s: float, lasted_s: float, budget_s: float) -> str:
    first_line = (str(error).splitlines() or [""])[0][:200]
    return (
        f"{what}: object storage outage ({type(error).__name__}: {first_line}); trying again in {delay_s:g} s "
        f"({lasted_s:.0f} s of up to {budget_s:g} s ridden out)"
    )


def ride_out_outage(
    call: Callable[[], R],
    what: str,
    backoff: OutageBackoff | None = None,
    warn: Callable[[str], None] | None = None,
) -> R:
    """`call()`, tried again through a storage outage until it has lasted `backoff.budget_s`; other errors at once.

    `backoff` defaults to this module's `OUTAGE_BACKOFF`, read at the call (a test may replace it). A failed
    launch is raised at once even when its ranks' diagnosis is a storage outage (`is_launch_failure`): a rank's
    OSError may be its own disk, and Prefect's retries record each failed launch.

    An outage lasts from its first failure (or from when a launch's fence began riding it out, `ridden_out`)
    until the store answers: a try that failed after running `backoff.new_outage_after_s` or longer, the store
    having answered a lease check of this stage (`store_answered`) since the failure before, failed in a new
    outage, counted (and paused for, from `first_delay_s`) from this failure. A try that fails sooner, or whose
    lease checks went unanswered (a store that hangs each request until it times out), is the same outage, so a
    store that answers lease reads but fails the stage's own requests on every try still fails it after
    `budget_s`.
    """
    backoff = backoff or OUTAGE_BACKOFF
    warn = warn or warning_to_this_run()
    outage_since: float | None = None
    pauses = backoff.delays()
    while True:
        started, answers = backoff.clock(), answers_so_far()
        try:
            return call()
        except Exception as error:
            if is_launch_failure(error) or not is_storage_outage(error):
                raise
            now = backoff.clock()
            answered = answers_so_far() != answers and now - started >= backoff.new_outage_after_s
            if outage_since is None or answered:  # a new outage; one a launch's fence rode out began earlier
                outage_since, pauses = now - float(getattr(error, RIDDEN_OUT_S, 0.0)), backoff.delays()
            lasted_s = now - outage_since
            if lasted_s >= backoff.budget_s:
                raise
            delay = next(pauses)
            warn(outage_warning(what, error, delay, lasted_s, backoff.budget_s))
            backoff.sleep(delay)


def rides_out_outages(stage: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Wrap a stage's task function so that a storage outage is ridden out (`ride_out_outage`) within one attempt.

    `OUTAGE_BACKOFF` is read when the stage runs, so a test can drive its clock and sleep.
    """

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(function)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            return ride_out_outage(lambda: function(*args, **kwargs), stage)

        return run

    return decorate


def warning_to_this_run() -> Callable[[str], None]:
    """The task run's logger (the Prefect UI) where there is one, Python's logging outside a run."""
    try:
        from prefect import get_run_logger

        return get_run_logger().warning
    except Exception:  # noqa: BLE001 - MissingContextError
        return logging.getLogger("rankflow.retry").warning


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
