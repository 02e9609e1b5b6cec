"""Experiment tracking: a run's params, per-step metrics and committed checkpoints in MLflow, TensorBoard or W&B.

The segment task feeds every progress record rank 0 writes (`trainer_core.run.progress`) to a `TrackingSink`,
which logs it from a thread of its own: a slow or unreachable tracking server never holds up a step, the
watchdog or the launch, and an outage is a warning counted in the segment's outcome, never a failure. A step is
logged once: each backend says the last step it holds (`TrackingBackend.logged_through`), and a resumed or
retried segment skips what is already there. When the flow run ends, `end_tracked_run` marks the record
FINISHED, FAILED or KILLED (MLflow's run status); a resumed run's record is marked running again.
`tracking.backend` picks the backend from `BACKENDS` (`registry.py`); each lives in a module of its own and is
imported only when a run asks for it.
"""

from .registry import BACKENDS, missing_library, open_backend
from .sink import TrackingSink, end_tracked_run, tag_checkpoint, tracking_sink_for

__all__ = [
    "BACKENDS",
    "TrackingSink",
    "end_tracked_run",
    "missing_library",
    "open_backend",
    "tag_checkpoint",
    "tracking_sink_for",
]
