"""Time one segment launch with the launcher and trainer core of the checkout in the current directory.

    cd CHECKOUT && python PATH/TO/bench/scripts/segment_launch.py RUN_DIR SEGMENT WORLD_SIZE

Prints one JSON object: the epoch seconds just before `infra.launch.launcher.launch` and just after it
returned, and rank 0's progress records of the segment. Run by its path from the checkout measured (the ranks
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
    from infra.launch.launcher import launch
    from trainer_core.run.progress import progress_path

    run_dir, segment, world_size = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    lines: list[str] = []
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
    print(json.dumps({"launch": started, "exit": ended, "records": records}))


if __name__ == "__main__":
    main()
