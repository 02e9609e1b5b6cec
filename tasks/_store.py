"""The object store and publication limits a planned run's tasks use."""

from __future__ import annotations

from infra.finalizer import FinalizerSettings
from infra.publication import PublishSettings
from infra.store.base import StoreLocation, StoreTimeouts, open_store

from trainer_core.config import RunConfig

from .outcomes import PlannedRun


def store_for(planned: PlannedRun) -> StoreLocation:
    request_s = planned.storage_request_timeout_s
    return open_store(planned.storage_url, StoreTimeouts(connect_s=min(10.0, request_s), read_s=request_s))


def open_store_for_config(config: RunConfig) -> StoreLocation:
    """The store of a run before it is planned (for its run lease), with the same request limits."""
    request_s = config.storage.request_timeout_s
    return open_store(config.storage.url, StoreTimeouts(connect_s=min(10.0, request_s), read_s=request_s))


def publish_settings(planned: PlannedRun) -> PublishSettings:
    # The run lease is checked inside the commit and cleanup too (infra/finalizer.py), not only before them.
    return PublishSettings(timeout_s=planned.storage_timeout_s,
                           finalizer=FinalizerSettings(run_lease_token=planned.lease_token))
