"""Infrastructure: object storage, run state in the store, checkpoint publication, torchrun launching, failure diagnosis, local services.

The names below are loaded on first use (PEP 562): a process that imports one
light module (`infra.store.base` in a committer or a lease holder) must not pay for
the launcher's trainer_core, torch and transformers imports (seconds per start).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer_core.lazy_exports import lazy_exports

_NAMES_BY_MODULE = {
    "publication.checkpoints": (
        "CheckpointReport",
        "LatestResolution",
        "download_checkpoint",
        "latest_checkpoint",
        "list_checkpoints",
        "pull_checkpoint",
        "resolve_latest",
        "scan_checkpoints",
        "verify_checkpoint",
    ),
    "store.verified": ("StoredObjectCorrupt",),
    "launch.failures": ("Failure", "FailureClass", "classify_exception", "diagnose_launch"),
    "publication.finalizer": ("FinalizerSettings", "FinalizerWaitTimeout"),
    "publication.journal": ("Journal", "PublicationState", "TransitionError"),
    "launch.launcher": ("LaunchError", "LaunchResult", "launch", "launch_or_raise"),
    "store.lease": ("Lease", "LeaseHeldError", "LeaseLostError", "LeaseRecord", "read_lease"),
    "publication.manifests": ("ManifestError", "checkpoint_name"),
    "publication.orphans": ("GarbageReport", "collect_garbage"),
    "store.preflight": ("StoreUnavailable",),
    "store.writable": ("check_store_writable",),
    "publication.commit": ("CommitOutcome", "PublishSettings", "StagedFileChanged", "commit_checkpoint"),
    "publication.cleanup": ("CleanupOutcome", "abort_publication", "cleanup_staging"),
    "runs.run_lease": ("RunAlreadyActive", "RunLeaseLost", "acquire_run_lease", "check_run_lease"),
    "runs.run_state": (
        "BundleManifest",
        "StateSettings",
        "fetch_bundle",
        "publish_bundle",
        "read_bundle_manifest",
        "stored_bundle",
    ),
    "store.base": ("StorageTimeoutError", "StoreLocation", "StoreTimeouts"),
    "store": ("open_store",),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _NAMES_BY_MODULE, globals())

if TYPE_CHECKING:
    from infra.launch.failures import Failure, FailureClass, classify_exception, diagnose_launch
    from infra.launch.launcher import LaunchError, LaunchResult, launch, launch_or_raise
    from infra.publication.checkpoints import (
        CheckpointReport,
        LatestResolution,
        download_checkpoint,
        latest_checkpoint,
        list_checkpoints,
        pull_checkpoint,
        resolve_latest,
        scan_checkpoints,
        verify_checkpoint,
    )
    from infra.publication.cleanup import CleanupOutcome, abort_publication, cleanup_staging
    from infra.publication.commit import CommitOutcome, PublishSettings, StagedFileChanged, commit_checkpoint
    from infra.publication.finalizer import FinalizerSettings, FinalizerWaitTimeout
    from infra.publication.journal import Journal, PublicationState, TransitionError
    from infra.publication.manifests import ManifestError, checkpoint_name
    from infra.publication.orphans import GarbageReport, collect_garbage
    from infra.runs.run_lease import RunAlreadyActive, RunLeaseLost, acquire_run_lease, check_run_lease
    from infra.runs.run_state import (
        BundleManifest,
        StateSettings,
        fetch_bundle,
        publish_bundle,
        read_bundle_manifest,
        stored_bundle,
    )

    from .store import open_store
    from .store.base import StorageTimeoutError, StoreLocation, StoreTimeouts
    from .store.lease import Lease, LeaseHeldError, LeaseLostError, LeaseRecord, read_lease
    from .store.preflight import StoreUnavailable
    from .store.verified import StoredObjectCorrupt
    from .store.writable import check_store_writable
