"""Fencing for the pipeline's writing stages: write only while this run holds its run lease.

Each stage that writes (segment, export, commit, cleanup, report) calls
`fence` before its first write and again before recording its outcome; a
segment also checks during its launch (`fenced_monitor`), so a run whose lease
was taken over stops its torchrun launch within `every_s` seconds instead of
training on beside the new holder. Commit, cleanup and the state uploads pass
the lease token into the finalizer (`fenced_settings`), which
checks it again right before each manifest, LATEST and journal write and after
each data file. A `PlannedRun` without a lease token (stages driven directly,
outside the flow) is not fenced.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from infra.publication.finalizer import FinalizerSettings
from infra.runs.run_lease import check_run_lease
from infra.store import open_store

from .outcomes import PlannedRun

if TYPE_CHECKING:
    from infra.publication.commit import PublishSettings
    from infra.runs.run_state import StateSettings

S = TypeVar("S", "PublishSettings", "StateSettings")

FENCE_EVERY_S = 2.0
"""How often a running launch re-checks the lease (one small read of the store)."""


def fence(planned: PlannedRun, stage: str) -> None:
    """Raise RunLeaseLost unless this run still holds its run lease."""
    if planned.lease_token is not None:
        check_run_lease(open_store(planned.storage), planned.run_id, planned.lease_token, stage)


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
    clock: Callable[[], float] = time.monotonic,
) -> Callable[[], str | None]:
    """`monitor`, plus a lease check every `every_s`: a lost lease raises RunLeaseLost, which ends the launch."""
    last_check = clock()

    def watch() -> str | None:
        nonlocal last_check
        if clock() - last_check >= every_s:
            last_check = clock()
            fence(planned, stage)  # raising here kills the launch's process group (infra/launch/launcher.py)
        return monitor() if monitor is not None else None

    return watch
