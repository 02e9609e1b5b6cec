"""Infrastructure: object storage, checkpoint publication, torchrun launching, failure diagnosis, local services."""

from .checkpoints import download_checkpoint, latest_checkpoint, list_checkpoints
from .failures import Failure, FailureClass, classify_exception, diagnose_launch
from .launcher import LaunchError, LaunchResult, launch, launch_or_raise
from .preflight import StoreUnavailable, check_store_writable
from .publication import CommitOutcome, checkpoint_name, cleanup_staging, commit_checkpoint
from .storage import StoreLocation, open_store

__all__ = [
    "CommitOutcome", "Failure", "FailureClass", "LaunchError", "LaunchResult", "StoreLocation", "StoreUnavailable",
    "check_store_writable", "checkpoint_name", "classify_exception", "cleanup_staging", "commit_checkpoint",
    "diagnose_launch", "download_checkpoint", "latest_checkpoint", "launch", "launch_or_raise", "list_checkpoints",
    "open_store",
]
