"""Infrastructure: object storage, checkpoint publication, torchrun launching, local services."""

from .checkpoints import download_checkpoint, latest_checkpoint, list_checkpoints
from .launcher import LaunchError, LaunchResult, launch, launch_or_raise
from .publication import CommitOutcome, checkpoint_name, cleanup_staging, commit_checkpoint
from .storage import StoreLocation, open_store

__all__ = [
    "CommitOutcome", "LaunchError", "LaunchResult", "StoreLocation", "checkpoint_name", "cleanup_staging",
    "commit_checkpoint", "download_checkpoint", "latest_checkpoint", "launch", "launch_or_raise",
    "list_checkpoints", "open_store",
]
