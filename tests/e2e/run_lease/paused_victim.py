"""A run that holds its run lease and stops itself (SIGSTOP) inside a commit or a state upload, for theft tests.

    python -m tests.e2e.run_lease.paused_victim STORE_URL RUN_ID RUN_DIR {commit STAGED STEP | state} --ttl-s S

Takes the run lease (ttl S), prints `ready`, then runs the commit stage
(tasks.publish.commit_fn) of the checkpoint staged at STAGED, or the state
upload of segment 0 (tasks.run_state.publish_segment_state), through the
pipeline's own functions. At the first data file uploaded it stops its whole
process with SIGSTOP (heartbeats included), as a paused machine would; a test
takes the lease over and sends SIGCONT. Prints one JSON line: the outcome, or
the error that ended it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
from pathlib import Path

import tasks.publish as publish_module
from infra.runs.run_lease import acquire_run_lease
from infra.store import open_store
from tasks.outcomes import ExportOutcome, PlannedRun
from tasks.run_state import publish_segment_state
from trainer_core.config import StorageSection, TrainSection


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("store_url")
    parser.add_argument("run_id")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("stage", choices=["commit", "state"])
    parser.add_argument("staged", nargs="?", type=Path)
    parser.add_argument("step", nargs="?", type=int)
    parser.add_argument("--ttl-s", type=float, default=2.0)
    args = parser.parse_args()
    store = open_store(args.store_url)
    lease = acquire_run_lease(store, args.run_id, ttl_s=args.ttl_s, wait_s=0)
    planned = PlannedRun(
        run_id=args.run_id,
        digest="d" * 64,
        run_dir=str(args.run_dir),
        segment_steps=[(0, args.step or 1)],
        train=TrainSection(segment_timeout_s=60),
        storage=StorageSection(url=args.store_url),
        lease_token=lease.record.token,
    )
    stopped: list[str] = []

    def stop_at_first_upload(event: str) -> None:
        if event.startswith("uploaded ") and not stopped:
            stopped.append(event)
            print("stopping", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)

    print("ready", flush=True)
    try:
        if args.stage == "commit":
            publish_module.commit_checkpoint = functools.partial(
                publish_module.commit_checkpoint, observer=stop_at_first_upload
            )
            staged = ExportOutcome(
                segment=0,
                step=args.step,
                staged_dir=str(args.staged),
                reused=False,
                num_files=0,
                num_bytes=0,
                launch_wall_s=0.0,
            )
            outcome = publish_module.commit_fn(planned, staged).to_dict()
        else:
            outcome = publish_segment_state(planned, 0, observer=stop_at_first_upload)
    except Exception as error:  # noqa: BLE001 - reported to the test as the result
        print(json.dumps({"error": type(error).__name__, "message": str(error), "stopped": stopped}), flush=True)
        return 0
    print(json.dumps({"outcome": outcome, "stopped": stopped}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
