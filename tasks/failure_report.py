"""A failed stage, reported: the ledger entry and a markdown artifact naming the stage, rank, cause and log lines.

Every failed attempt is reported, retried or not, so the flow run page shows
the latest failure (artifact key `RUN_ID-failure`) and the ledger keeps them all.
"""

from __future__ import annotations

from pathlib import Path

from prefect.artifacts import create_markdown_artifact
from prefect.context import TaskRunContext

from infra import ledger
from infra.failures import Failure, classify_exception

from .live import artifact_key, in_prefect_run


def failure_of(stage: str, error: BaseException) -> Failure:
    """The diagnosis a launch error carries, or one made from an orchestrator-side exception."""
    diagnosed = getattr(error, "failure", None)
    if isinstance(diagnosed, Failure):
        return Failure(stage, diagnosed.cause, diagnosed.rank, diagnosed.detail, diagnosed.log_tail)
    message = (str(error).splitlines() or [""])[0][:300]
    return Failure(getattr(error, "stage", stage), classify_exception(error), None, f"{type(error).__name__}: {message}")


def _attempt() -> str:
    context = TaskRunContext.get()
    if context is None or context.task_run is None:
        return ""
    return f" (attempt {context.task_run.run_count} of {context.task.retries + 1})"


def failure_markdown(run_id: str, failure: Failure, attempt: str = "") -> str:
    rank = "—" if failure.rank is None else str(failure.rank)
    verdict = "yes, from the last saved state" if failure.retriable else "no: fix the cause, then run the same config again"
    lines = "\n".join(failure.log_tail) or "(no log lines)"
    return (
        f"## {failure.stage} failed{attempt}\n\n"
        f"| run | stage | first failing rank | cause | retried |\n|---|---|---|---|---|\n"
        f"| `{run_id}` | {failure.stage} | {rank} | **{failure.cause.value}** | {verdict} |\n\n"
        f"**What happened:** {failure.detail}\n\n"
        f"### Last lines of {'rank ' + rank if failure.rank is not None else 'the launch'}\n\n```\n{lines}\n```\n"
    )


def report_failure(run_dir: Path | None, run_id: str, stage: str, error: BaseException, **where) -> Failure:
    """Record the failure in the ledger (once the run has a directory) and, inside a Prefect run, as an artifact."""
    failure = failure_of(stage, error)
    if run_dir is not None:
        ledger.record(run_dir, failure.stage, "failed", error=failure.headline(), failure=failure.to_dict(), **where)
    if in_prefect_run():
        attempt = _attempt()
        create_markdown_artifact(
            key=artifact_key(run_id, "failure"), markdown=failure_markdown(run_id, failure, attempt),
            description=failure.headline(),
        )
    return failure
