"""A process that takes a lease repeatedly (or once, then hangs), for lease tests.

python -m tests.storage.lease_holder STORE_URL NAME --rounds N --hold-s S    prints JSON intervals
python -m tests.storage.lease_holder STORE_URL NAME --hang                   prints `held`, then sleeps
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from infra.store import open_store
from infra.store.lease import Lease


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("store_url")
    parser.add_argument("name")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--hold-s", type=float, default=0.2)
    parser.add_argument("--ttl-s", type=float, default=30.0)
    parser.add_argument("--hang", action="store_true")
    args = parser.parse_args()
    store = open_store(args.store_url)
    print("ready", flush=True)
    lease = Lease.for_run(store, "lease-run", args.name, ttl_s=args.ttl_s)
    if args.hang:
        lease.acquire(wait_s=60)
        lease.start_heartbeat()
        print("held", flush=True)
        time.sleep(3600)
        return 0
    intervals = []
    for _ in range(args.rounds):
        with lease.hold(wait_s=120):
            started = time.time()
            time.sleep(args.hold_s)
            lease.check()
            intervals.append((started, time.time(), lease.record.generation))
    print(json.dumps(intervals), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
