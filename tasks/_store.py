"""The object store and publication limits a planned run's tasks use."""

from __future__ import annotations

from dataclasses import dataclass

from infra.finalizer import FinalizerSettings
from infra.publication import PublishSettings
from infra.store import ObjectStore, open_store

from trainer_core.config import RunConfig

from .outcomes import PlannedRun


@dataclass(frozen=True)
class _PlannedStorage:
    """A planned run's storage facts as the `StorageSettings` open_store takes (its request limits included)."""

    url: str
    timeout_s: float
    request_timeout_s: float


def store_for(planned: PlannedRun) -> ObjectStore:
    return open_store(_PlannedStorage(planned.storage_url, planned.storage_timeout_s,
                                      planned.storage_request_timeout_s))


def open_store_for_config(config: RunConfig) -> ObjectStore:
    """The store of a run before it is planned (for its run lease), with the same request limits."""
    return open_store(config.storage)


def publish_settings(planned: PlannedRun) -> PublishSettings:
    # The run lease is checked inside the commit and cleanup too (infra/finalizer.py), not only before them.
    return PublishSettings(timeout_s=planned.storage_timeout_s,
                           finalizer=FinalizerSettings(run_lease_token=planned.lease_token))
