"""A committing process for tests that race, pause and kill committers.

    python -m tests.storage.committer STAGED RUN_ID STORE_URL [--hold EVENT] [--wait-go] [--latest-only STEP]
                                      [--kill-at N]

Prints `ready` once imported and connected; with --wait-go it then waits for a
line on stdin before committing, so a test can time a SIGKILL from the start
of the commit. With --kill-at N it SIGKILLs itself when the commit reaches its
N-th event (0: right after the go, before the commit starts), after printing
`killed at EVENT`: a crash at an exact phase boundary, whatever the machine's
load. With --hold EVENT it prints `held at EVENT` when the commit reaches EVENT
and waits there for a line on stdin: a test lets a second committer run into
that window and releases the first once the second is where it must be.
Prints one JSON line with the outcome and the events it passed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from infra.publication.commit import commit_checkpoint
from infra.publication.latest import advance_latest
from infra.store import open_store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("staged", type=Path)
    parser.add_argument("run_id")
    parser.add_argument("store_url")
    parser.add_argument("--hold", default=None, help="EVENT: at EVENT, say so and wait for a line on stdin")
    parser.add_argument("--wait-go", action="store_true")
    parser.add_argument("--latest-only", type=int, default=None, help="only move LATEST to this step (no lease)")
    parser.add_argument("--kill-at", type=int, default=None, help="SIGKILL this process at the commit's N-th event")
    args = parser.parse_args(argv)
    store = open_store(args.store_url)
    store.fs.exists(store.path(args.run_id))  # connect before saying ready

    events: list[str] = []

    def observe(event: str) -> None:
        events.append(event)
        if len(events) == args.kill_at:
            die_at(event)
        if event == args.hold:
            print(f"held at {event}", flush=True)
            sys.stdin.readline()

    print("ready", flush=True)
    if args.wait_go:
        sys.stdin.readline()
    if args.kill_at == 0:
        die_at("go")
    started = time.time()
    if args.latest_only is not None:
        move = advance_latest(store, args.run_id, args.latest_only, on_read=lambda: observe("latest-read"))
        print(
            json.dumps({"moved": move.moved, "step": move.step, "started": started, "ended": time.time()}), flush=True
        )
        return 0
    outcome = commit_checkpoint(args.staged, store, args.run_id, observer=observe)
    print(json.dumps({**outcome.to_dict(), "events": events, "started": started, "ended": time.time()}), flush=True)
    return 0


def die_at(event: str) -> None:
    """A crash exactly here: no finally block, no lease release, no buffered write survives a SIGKILL."""
    print(f"killed at {event}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
