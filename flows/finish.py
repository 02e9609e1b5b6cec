"""End `rankflow run` within a moment of its last line, leaving no process behind.

Python's normal exit runs Prefect's exit hooks: they drain the log and event
workers and then stop the temporary API server (`SubprocessASGIServer.stop`:
SIGTERM, up to 5 s for uvicorn's graceful shutdown, then SIGKILL), and the
interpreter then tears down torch and friends — 8 to 70 s on a loaded machine
after the result line, with nothing left to do. Here the durable part comes
first and the rest is cut short:

1. `drain_prefect`, before the result line: the log records and events still
   queued reach the API (bounded), so the UI has the whole run;
2. the caller prints the result line;
3. `stop_temporary_server`: the server gets SIGTERM and `grace_s` to stop,
   then SIGKILL, and is reaped (its SQLite database is crash-safe, and every
   write the run needed was answered before step 2);
4. `exit_now`: flush the standard streams and `os._exit`, skipping the exit
   hooks (whose work is done) and the interpreter's teardown.

Everything the run records on disk (ledger, journals, store objects) was
already written and fsynced by the stages themselves before the flow returned.
"""

from __future__ import annotations

import subprocess

DRAIN_TIMEOUT_S = 5.0
"""The longest the queued logs and events may take to reach the API (Prefect's own exit hook allows 5 s too)."""
SERVER_GRACE_S = 1.0
"""How long the temporary server gets to stop on SIGTERM before it is killed."""


def drain_prefect(timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """Send the log records and events still queued to the Prefect API, waiting at most `timeout_s` each."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout_s)


def stop_temporary_server(grace_s: float = SERVER_GRACE_S) -> list[int]:
    """Stop Prefect's temporary API server(s) of this process without the 5 s wait; returns their pids."""
    from prefect.server.api.server import SubprocessASGIServer

    stopped = []
    for server in list(SubprocessASGIServer._instances.values()):
        process = server.server_process
        if process is None:
            continue
        process.terminate()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        server.server_process, server.running = None, False  # Prefect's own exit hook then has nothing to stop
        stopped.append(process.pid)
    return stopped


def exit_now(code: int) -> None:
    """Flush stdout and stderr and end the process at once with `code` (as a finished rank leaves)."""
    from trainer_core.run.rank_process import leave_now

    leave_now(code)
