"""Time one segment launch with the launcher and trainer core of the checkout in the current directory.

    cd CHECKOUT && python PATH/TO/bench/scripts/segment_launch.py RUN_DIR SEGMENT WORLD_SIZE

Prints one JSON object: the epoch seconds just before `infra.launch.launcher.launch` and just after it
returned, and rank 0's progress records of the segment. As a run does, the launch is made with the run's
warm process (`infra.launch.warm_ranks`: the ranks are forked with their imports done), started and ready
before the clock starts (a run starts it before Prefect's temporary server, seconds before its first
launch); `warm_ready_s` says how long it took. With RANKFLOW_WARM_RANKS=0, or from a checkout without
one, every rank imports by itself. Run by its path from the checkout measured (the ranks
import from the current directory, as `python -m` would), so `bench.launch` can time two checkouts' launches
side by side, interleaved, through the same script.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    sys.path.insert(0, os.getcwd())
    from contextlib import nullcontext

    from infra.launch.launcher import launch
    from trainer_core.run.progress import progress_path

    try:
        from infra.launch.warm_ranks import warm_ranks
    except ImportError:  # a checkout from before warm processes
        warm_ranks = nullcontext
    run_dir, segment, world_size = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    lines: list[str] = []
    with warm_ranks() as warm:
        ready_wait = time.time()
        while warm is not None and not warm.is_ready() and warm.process.poll() is None:
            time.sleep(0.02)
        warm_ready_s = time.time() - ready_wait if warm is not None else None
        started = time.time()
        result = launch(
            "trainer_core.run.segment_main",
            ["--run-dir", str(run_dir), "--segment", str(segment)],
            nproc_per_node=world_size,
            timeout_s=600,
            on_line=lines.append,
            env={"PYTHONPATH": os.getcwd()},
        )
        ended = time.time()
    if result.returncode != 0:
        sys.exit("segment launch failed:\n" + "\n".join(lines[-30:]))
    records = [json.loads(line) for line in progress_path(run_dir, segment).read_text().splitlines()]
    print(json.dumps({"launch": started, "exit": ended, "records": records, "warm_ready_s": warm_ready_s}))


if __name__ == "__main__":
    main()
