"""Keep a launch's full logs in the store next to the run: every line of every rank, whatever Prefect was sent.

A launch writes each rank's stdout and stderr to files of their own under
its log folder (RUN_DIR/logs/STAGE-NNNN/ATTEMPT/…; `infra.launch.rank_logs`)
and torchrun's own lines to `torchrun.log` there. When the launch ends,
failed or not, the folder is uploaded under the same relative path,

    RUN_ID/logs/STAGE-NNNN/ATTEMPT/…

so the logs of a node on another machine, or of a work dir since deleted,
stay readable. The logs are no part of the run's state: an upload that fails
is reported as a warning and fails nothing, and a store that does not answer
holds the stage up for at most `LOG_UPLOAD_LIMIT_S` (short request limits, one
retry) rather than the state uploads' limits. Like every write of the run, it
is fenced: a run that lost its run lease stores no logs (another run of the
run id owns the prefix, with logs of the same attempt names).
"""

from __future__ import annotations

import logging
from pathlib import Path

from infra.publication.manifests import FileEntry
from infra.runs.run_lease import RunLeaseLost
from infra.store import open_store
from infra.store.base import Deadline, StoreTimeouts
from infra.store.objects import upload_files
from infra.store.verified import sha256_of_file

from .fencing import fence
from .outcomes import PlannedRun

__all__ = ["store_launch_logs"]

_log = logging.getLogger(__name__)

LOG_UPLOAD_LIMIT_S = 60.0
_LOG_REQUESTS = StoreTimeouts(connect_s=5.0, read_s=15.0, max_attempts=2)


def store_launch_logs(planned: PlannedRun, run_dir: Path, log_dir: Path) -> int:
    """Upload every file under `log_dir` (inside `run_dir`) to the run's prefix in the store; returns how many."""
    if not log_dir.is_dir():
        return 0
    entries = []
    for path in sorted(p for p in log_dir.rglob("*") if p.is_file()):
        size, digest = sha256_of_file(path)
        entries.append(FileEntry(path=path.relative_to(run_dir).as_posix(), size=size, sha256=digest))
    store = open_store(planned.storage, _LOG_REQUESTS)
    what = f"upload of the logs in {log_dir}"
    try:
        fence(planned, what)
    except RunLeaseLost:
        return 0  # the launch's own error (or the next fence) says the lease is lost; the logs stay on disk
    except OSError as error:
        _log.warning("the launch's logs stay only in %s: %s", log_dir, error)
        return 0
    try:
        with store.errors(what):
            deadline = Deadline(min(planned.storage.timeout_s, LOG_UPLOAD_LIMIT_S), what, store)
            upload_files(store, run_dir, store.path(planned.run_id), entries, deadline, lambda _: None)
    except OSError as error:
        _log.warning("the launch's logs stay only in %s: %s", log_dir, error)
        return 0
    return len(entries)
