"""Fencing for the pipeline's writing stages: write only while this run holds its run lease.

Each stage that writes (segment, export, commit, cleanup, report) calls
`fence` before its first write, and segment and export again before
recording their outcome (through `tasks.stage.Stage`); a
segment also checks during its launch (`fenced_monitor`), so a run whose lease
was taken over stops its torchrun launch within `every_s` seconds instead of
training on beside the new holder. Commit, cleanup and the state uploads pass
the lease token into the finalizer (`fenced_settings`), which
checks it again right before each manifest, LATEST and journal write and after
each data file. A `PlannedRun` without a lease token (stages driven directly,
outside the flow) is not fenced.

A launch's fence rides out a storage outage (`tasks.retry_policy.OutageBackoff`):
a check that cannot read the lease leaves the launch running and is tried
again, less often as the outage goes on, and only an outage past the budget
(5 minutes) ends the launch; a takeover seen once the store answers again
still ends it at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

from infra.publication.finalizer import FinalizerSettings
from infra.runs.run_lease import check_run_lease
from infra.store import open_store

from . import retry_policy
from .outcomes import PlannedRun
from .retry_policy import OutageBackoff, is_storage_outage, outage_warning, ridden_out, warning_to_this_run

if TYPE_CHECKING:
    from infra.publication.commit import PublishSettings
    from infra.runs.run_state import StateSettings

S = TypeVar("S", "PublishSettings", "StateSettings")

FENCE_EVERY_S = 2.0
"""How often a running launch re-checks the lease (one small read of the store)."""


def fence(planned: PlannedRun, stage: str) -> None:
    """Raise RunLeaseLost unless this run still holds its run lease.

    A check answered tells this thread's outage ride-out that the store answered (`retry_policy.store_answered`).
    """
    if planned.lease_token is not None:
        check_run_lease(open_store(planned.storage), planned.run_id, planned.lease_token, stage)
        retry_policy.store_answered()


def fenced_settings(planned: PlannedRun, kind: type[S]) -> S:
    """The limits of one commit, cleanup or bundle upload (`storage.timeout_s`), fenced by the run lease inside it.

    The finalizer checks the lease right before each manifest, LATEST and journal write, not only before the stage.
    """
    return kind(timeout_s=planned.storage.timeout_s, finalizer=FinalizerSettings(run_lease_token=planned.lease_token))


def fenced_monitor(
    planned: PlannedRun,
    stage: str,
    monitor: Callable[[], str | None] | None,
    every_s: float = FENCE_EVERY_S,
    clock: Callable[[], float] | None = None,
    backoff: OutageBackoff | None = None,
    warn: Callable[[str], None] | None = None,
) -> Callable[[], str | None]:
    """`monitor`, plus a lease check every `every_s`: a lost lease raises RunLeaseLost, which ends the launch.

    A check the store cannot answer is tried again after `backoff`'s growing pauses (measured on `clock`); the
    launch ends on the outage only once it has lasted `backoff.budget_s`. `backoff` defaults to
    `retry_policy.OUTAGE_BACKOFF` as it is when the launch starts (a test may replace it), `clock` to its clock.
    """
    backoff = backoff or retry_policy.OUTAGE_BACKOFF
    clock = clock or backoff.clock
    warn = warn or warning_to_this_run()
    last_check = clock()
    next_check_s = every_s
    outage_since: float | None = None
    pauses: Iterator[float] | None = None

    def watch() -> str | None:
        nonlocal last_check, next_check_s, outage_since, pauses
        now = clock()
        if now - last_check >= next_check_s:
            last_check = now
            try:
                fence(planned, stage)  # raising here kills the launch's process group (infra/launch/launcher.py)
            except Exception as error:
                if not is_storage_outage(error):
                    raise
                outage_since = now if outage_since is None else outage_since
                if now - outage_since >= backoff.budget_s:
                    ridden_out(error, now - outage_since)  # the segment's own ride-out does not wait it out again
                    raise
                pauses = pauses or backoff.delays()
                next_check_s = max(every_s, next(pauses))
                warn(
                    outage_warning(
                        f"{stage}: the run lease check", error, next_check_s, now - outage_since, backoff.budget_s
                    )
                )
            else:
                next_check_s, outage_since, pauses = every_s, None, None
        return monitor() if monitor is not None else None

    return watch
