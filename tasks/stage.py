"""The envelope every writing stage of the pipeline runs in.

Two halves, each written once here instead of once per stage:

- `stage_task`: the stage's Prefect task. Each failed attempt is reported
  (`tasks.failure_report.reports_failures`: a ledger line, a log file, the
  run's failure artifact; a lost run lease is not, the run directory belongs
  to its new holder), a storage outage is ridden out within the attempt
  (`tasks.retry_policy.rides_out_outages`), and the retries and the condition
  that decides them are the stage's own.
- `Stage`: one attempt, fenced by the run lease (`tasks.fencing`). `enter`
  fences before the attempt's first write; the stage calls `fence` again
  where its outcome is about to be recorded (segment, export, state upload:
  after their launch or wait); `record` writes its ledger line; `on_failure`
  undoes or records what a failed step left, passing a lost run lease
  through untouched (what the attempt wrote belongs to the run that holds the
  lease now).

Commit, cleanup and retention fence only on entry: the finalizer checks the
lease again right before each write they make (`fencing.fenced_settings`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import Task, task
from prefect.cache_policies import NO_CACHE

from infra.runs import ledger
from infra.runs.run_lease import RunLeaseLost

from .failure_report import reports_failures
from .fencing import fence
from .outcomes import PlannedRun
from .retry_policy import rides_out_outages


def stage_task(
    name: str,
    *,
    run_name: str | Callable[[], str],
    retries: int,
    retry_delay_seconds: Sequence[float],
    retry_condition_fn: Callable[..., bool],
    rides_out: bool = True,
) -> Callable[[Callable[..., Any]], Task[..., Any]]:
    """The Prefect task of stage `name`: failed attempts reported; outages ridden out unless `rides_out` is False.

    Never cached: a stage's outcome is its journal and the store, read each attempt.
    """

    def decorate(function: Callable[..., Any]) -> Task[..., Any]:
        attempt = rides_out_outages(name)(function) if rides_out else function
        return task(
            name=name,
            task_run_name=run_name,
            retries=retries,
            retry_delay_seconds=list(retry_delay_seconds),
            retry_condition_fn=retry_condition_fn,
            cache_policy=NO_CACHE,
        )(reports_failures(name)(attempt))

    return decorate


@dataclass(frozen=True)
class Stage:
    """One attempt of a writing stage of `planned`: its fence and its ledger lines."""

    planned: PlannedRun
    name: str
    """The stage's name in the ledger: segment, export, commit, …"""
    what: str
    """What a lost run lease names: "segment 3", "export of segment 3", …"""

    @classmethod
    def enter(cls, planned: PlannedRun, name: str, what: str) -> Stage:
        """The attempt, once the run lease is checked: RunLeaseLost before any write when another run holds it."""
        attempt = cls(planned, name, what)
        attempt.fence()
        return attempt

    def fence(self) -> None:
        fence(self.planned, self.what)

    def record(self, status: str, **figures: Any) -> None:
        """The attempt's ledger line (a failure's is `reports_failures`'s)."""
        ledger.record(Path(self.planned.run_dir), self.name, status, **figures)

    @contextmanager
    def on_failure(
        self, handle: Callable[[Exception], None], errors: tuple[type[Exception], ...] = (Exception,)
    ) -> Iterator[None]:
        """Call `handle` with an error of `errors` the block raises, then let it go on; a lost lease goes on alone."""
        try:
            yield
        except RunLeaseLost:
            raise  # what the attempt wrote belongs to the run that holds the lease now
        except errors as error:
            handle(error)
            raise
