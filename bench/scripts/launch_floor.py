"""The floor of a launch: a torchrun rank that imports torch, joins a gloo process group and leaves.

    python -m torch.distributed.run --standalone --nproc-per-node=W bench/scripts/launch_floor.py --out FILE

Run by its path (not as a module), so it needs nothing of rankflow: `bench.launch` measures the floor with
the same script whichever code it measures the segment launches of. Rank 0 writes its marks (epoch seconds)
to FILE: when the process started, when its imports were done and when the process group was up. The
process's start is taken as a segment's ranks take it (`trainer_core/run/launch_phases.py`, loaded by its
path: standard library only), so the two splits line up; psutil's `create_time` adds the start to /proc/stat's
whole-second `btime` and was up to a second early here, which moved torchrun's own start-up (importing torch)
into the rank's imports.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

LAUNCH_PHASES = Path(__file__).resolve().parents[2] / "trainer_core" / "run" / "launch_phases.py"


def _process_start_time() -> float | None:
    spec = importlib.util.spec_from_file_location("_launch_phases", LAUNCH_PHASES)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.process_start_time()


def main() -> None:
    process_start = _process_start_time()
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
