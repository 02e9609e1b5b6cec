"""A failed attempt, reported once: a ledger line, a log file with the whole error, and the run's failure artifact.

Every failed attempt of every stage is reported, retried or not
(`reports_failures` wraps each stage's task function), so the ledger holds one
failure line per attempt and the flow run page shows the latest failure
(artifact key `RUN_ID-failure`, one per flow run, updated in place). The
report says which attempt failed and whether Prefect runs the task again,
asked of the task's own retry condition, the one Prefect itself consults: a
stage that fails outside any task (the flow's own code) is not retried by
anything. The full error (a launch's last lines, the Python traceback with
its causes) goes to `RUN_DIR/logs/failures/`, so the terminal and the UI can
keep to one line. An exception is reported once, however many layers see it
pass (the launch, the task, the flow).

A full disk must not hide itself. A rank on a full disk often cannot record
its error, nor even log it, so its launch fails with a bare exit status: a
failure of no clear cause while the run directory's disk is full is a full
disk (`no_space`), and the error carries that diagnosis, so the task's retry
condition sees it too (a full disk is not retried). When the ledger line or
the log file cannot be written either, the failure is still returned and shown.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from prefect.context import TaskRunContext

from infra.launch.failures import Failure, FailureClass, classify_exception, no_space_error
from infra.launch.no_space import describe_no_space, disk_is_full
from infra.runs import ledger
from infra.runs.run_lease import RunAlreadyActive, RunLeaseLost

from .live import artifact_key, artifact_link, in_prefect_run, upsert_markdown_artifact

_REPORTED = "_rankflow_failure"
"""Attribute an exception carries once reported: the Failure, so later layers reuse it."""

_VAGUE = (FailureClass.TRANSIENT, FailureClass.CODE_ERROR)
"""Causes a full disk can pass for: an unexplained exit, or a writer's error that names no errno."""

log = logging.getLogger(__name__)


def reported(error: BaseException) -> Failure | None:
    """The Failure `error` was reported as, if it was."""
    return getattr(error, _REPORTED, None)


def failure_of(stage: str, error: BaseException, run_dir: Path | None = None) -> Failure:
    """The diagnosis a launch error carries, or one made from an orchestrator-side exception."""
    diagnosed = getattr(error, "failure", None)
    if isinstance(diagnosed, Failure):
        failure = dataclasses.replace(diagnosed, stage=stage)
    else:
        message = (str(error).splitlines() or [""])[0][:300]
        failure = Failure(
            getattr(error, "stage", stage), classify_exception(error), None, f"{type(error).__name__}: {message}"
        )
    if failure.cause in _VAGUE and run_dir is not None and disk_is_full(run_dir):
        failure = dataclasses.replace(failure, cause=FailureClass.NO_SPACE)
    if failure.cause is FailureClass.NO_SPACE:
        full = no_space_error(error)
        where = Path(full.filename) if full is not None and full.filename else run_dir
        if where is not None:
            failure = dataclasses.replace(failure, detail=f"{describe_no_space(where)}; {failure.detail}")
    return failure


def _attempt_truth(error: BaseException) -> dict:
    """This attempt's number, the task's attempts and whether Prefect retries it (its retry condition decides)."""
    context = TaskRunContext.get()
    if context is None or context.task_run is None:
        return {"attempt": None, "max_attempts": None, "retried": False}  # the flow's own code: nothing retries it
    task, task_run = context.task, context.task_run
    attempt, retries = max(task_run.run_count, 1), task.retries
    retried = attempt <= retries  # Prefect retries while fewer than `retries` retries have run
    if retried and task.retry_condition_fn is not None:
        from prefect.states import Failed

        retried = bool(task.retry_condition_fn(task, task_run, Failed(data=error)))
    return {"attempt": attempt, "max_attempts": retries + 1, "retried": retried}


def failure_markdown(run_id: str, failure: Failure) -> str:
    rank = "—" if failure.rank is None else str(failure.rank)
    attempt = f" (attempt {failure.attempt} of {failure.max_attempts})" if failure.attempt is not None else ""
    if failure.retried:
        verdict = "yes, from the last saved state"
    else:
        verdict = "no: " + failure.verdict().split("not retried: ", 1)[-1]
    lines = "\n".join(failure.log_tail) or "(no log lines)"
    log_file = f"\n\n**Full error and traceback:** {artifact_link(failure.log_file)}" if failure.log_file else ""
    return (
        f"## {failure.stage} failed{attempt}\n\n"
        f"| run | stage | first failing rank | cause | retried |\n|---|---|---|---|---|\n"
        f"| `{run_id}` | {failure.stage} | {rank} | **{failure.cause.value}** | {verdict} |\n\n"
        f"**What happened:** {failure.detail}{log_file}\n\n"
        f"### Last lines of {'rank ' + rank if failure.rank is not None else 'the launch'}\n\n```\n{lines}\n```\n"
    )


def _write_log(run_dir: Path, failure: Failure, error: BaseException, where: dict) -> str:
    """The attempt's whole story in RUN_DIR/logs/failures/: headline, the full message, the traceback with its causes."""
    directory = run_dir / "logs" / "failures"
    directory.mkdir(parents=True, exist_ok=True)
    place = "".join(f"-{key}-{value}" for key, value in sorted(where.items()))
    attempt = f"-attempt-{failure.attempt}" if failure.attempt is not None else ""
    path = directory / f"{time.strftime('%Y%m%dT%H%M%S')}-{time.monotonic_ns()}-{failure.stage}{place}{attempt}.log"
    launch_logs = getattr(getattr(error, "result", None), "log_dir", None)
    text = (
        f"{failure.headline()}\n\n"
        + (f"rank logs: {launch_logs}\n\n" if launch_logs else "")
        + "".join(traceback.format_exception(error))
    )
    path.write_text(text)
    return str(path)


def report_failure(run_dir: Path | None, run_id: str, stage: str, error: BaseException, **where) -> Failure:
    """Report `error` (once): the log file and the ledger line once the run has a directory, and the artifact."""
    earlier = reported(error)
    if earlier is not None:
        return earlier
    failure = failure_of(stage, error, run_dir)
    if failure.cause is not classify_exception(error):
        try:
            setattr(error, "failure", failure)  # noqa: B010 - typed BaseException has no such attribute; the refined diagnosis travels with the error: the retry condition reads it
        except AttributeError:  # an exception type without a __dict__ keeps its own class
            pass
    failure = dataclasses.replace(failure, **_attempt_truth(error))
    if run_dir is not None:
        # A full disk, typically, fails these writes: the failure is still shown, and it is the error raised.
        try:
            failure = dataclasses.replace(failure, log_file=_write_log(run_dir, failure, error, where))
        except OSError as unwritten:
            log.warning("the error of %s could not be written under %s: %s", failure.stage, run_dir, unwritten)
        try:
            ledger.record(
                run_dir, failure.stage, "failed", error=failure.headline(), failure=failure.to_dict(), **where
            )
        except OSError as unrecorded:
            log.warning("the failure of %s could not be recorded in %s: %s", failure.stage, run_dir, unrecorded)
    if in_prefect_run():
        upsert_markdown_artifact(artifact_key(run_id, "failure"), failure_markdown(run_id, failure), failure.headline())
    try:
        setattr(error, _REPORTED, failure)
    except AttributeError:  # an exception type without a __dict__: reported again at worst
        pass
    return failure


def _run_of(arguments: dict) -> tuple[Path | None, str] | None:
    """The run directory and id a stage's arguments name: a planned run, or a config with its computed plan."""
    planned = arguments.get("planned")
    if planned is not None:
        return Path(planned.run_dir), planned.run_id
    config, computed = arguments.get("config"), arguments.get("computed")
    if config is not None and computed is not None:
        from trainer_core.run.plan import run_dir_for

        return run_dir_for(config, computed.run_id), computed.run_id
    return None


def _where(arguments: dict) -> dict:
    if "segment_index" in arguments:
        return {"segment": arguments["segment_index"]}
    exported = arguments.get("exported")
    return {"segment": exported.segment, "step": exported.step} if exported is not None else {}


def reports_failures(stage: str) -> Callable[[Callable], Callable]:
    """Wrap a stage's task function so that each failed attempt is reported before it propagates.

    A lost or taken run lease is not reported: the run directory belongs to the run that holds it now.
    """

    def decorate(function: Callable) -> Callable:
        signature = inspect.signature(function)

        @functools.wraps(function)
        def run(*args, **kwargs):
            try:
                return function(*args, **kwargs)
            except (RunLeaseLost, RunAlreadyActive):
                raise
            except Exception as error:
                arguments = signature.bind_partial(*args, **kwargs).arguments
                run_of = _run_of(arguments)
                if run_of is not None:
                    report_failure(*run_of, stage, error, **_where(arguments))
                raise

        return run

    return decorate
