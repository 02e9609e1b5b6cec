"""The floor of a launch: a torchrun rank that imports torch, joins a gloo process group and leaves.

    python -m torch.distributed.run --standalone --nproc-per-node=W bench/scripts/launch_floor.py --out FILE

Run by its path (not as a module), so it needs nothing of rankflow: `bench.launch` measures the floor with
the same script whichever code it measures the segment launches of. Rank 0 writes its marks (epoch seconds)
to FILE: when the process started, when its imports were done and when the process group was up.
"""

from __future__ import annotations

import argparse
import json
import time

import psutil


def main() -> None:
    process_start = psutil.Process().create_time()
    import torch.distributed as dist

    imports_done = time.time()
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    dist.barrier()
    ready = time.time()
    if dist.get_rank() == 0:
        marks = {"process_start": process_start, "imports_done": imports_done, "ready": ready}
        with open(args.out, "w") as handle:
            json.dump(marks, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
