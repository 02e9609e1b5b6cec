"""Infrastructure: object storage, run state in the store, checkpoint publication, torchrun launching, failure diagnosis, local services."""

from .checkpoints import (CheckpointReport, LatestResolution, download_checkpoint, latest_checkpoint, list_checkpoints,
                          pull_checkpoint, resolve_latest, scan_checkpoints, verify_checkpoint)
from .store.verified import StoredObjectCorrupt
from .failures import Failure, FailureClass, classify_exception, diagnose_launch
from .finalizer import FinalizerSettings, FinalizerWaitTimeout
from .journal import Journal, PublicationState, TransitionError
from .launcher import LaunchError, LaunchResult, launch, launch_or_raise
from .store.lease import Lease, LeaseHeldError, LeaseLostError, LeaseRecord, read_lease
from .manifests import ManifestError, checkpoint_name
from .orphans import GarbageReport, collect_garbage
from .store.preflight import StoreUnavailable, check_store_writable
from .publication import (CleanupOutcome, CommitOutcome, PublishSettings, StagedFileChanged, abort_publication,
                          cleanup_staging, commit_checkpoint)
from .run_lease import RunAlreadyActive, RunLeaseLost, acquire_run_lease, check_run_lease
from .run_state import (BundleManifest, StateSettings, fetch_bundle, publish_bundle, read_bundle_manifest,
                        stored_bundle)
from .store.base import StorageTimeoutError, StoreLocation, StoreTimeouts, open_store

__all__ = [
    "BundleManifest", "CheckpointReport", "CleanupOutcome", "CommitOutcome", "Failure", "FailureClass",
    "FinalizerSettings", "FinalizerWaitTimeout", "GarbageReport", "Journal", "LatestResolution", "LaunchError",
    "LaunchResult", "Lease", "LeaseHeldError", "LeaseLostError", "LeaseRecord", "ManifestError", "PublicationState",
    "PublishSettings", "RunAlreadyActive", "RunLeaseLost", "StagedFileChanged", "StateSettings",
    "StorageTimeoutError", "StoreLocation", "StoreTimeouts", "StoreUnavailable", "StoredObjectCorrupt",
    "TransitionError", "abort_publication", "acquire_run_lease", "check_run_lease", "check_store_writable",
    "checkpoint_name", "classify_exception", "cleanup_staging", "collect_garbage", "commit_checkpoint",
    "diagnose_launch", "download_checkpoint", "fetch_bundle", "latest_checkpoint", "launch", "launch_or_raise",
    "list_checkpoints", "open_store", "publish_bundle", "pull_checkpoint", "read_bundle_manifest", "read_lease",
    "resolve_latest", "scan_checkpoints", "stored_bundle", "verify_checkpoint",
]
