"""Time to fail of a segment whose rank is stopped or killed mid-step: the watchdog vs the collective timeout alone.

    python -m bench.time_to_fail [--repetitions 2] [--stall-timeout-s 10] [--collective-timeout-s 120]

A real 2-rank torchrun launch of the tiny model; rank 1 is stopped (SIGSTOP)
or killed (SIGKILL) at step 1 by `trainer_core.run.faults`. The time to fail runs
from the fault (the marker file it writes) to the end of the launch, when the
segment task raises and no process of the launch is left.

- baseline: a stopped rank with no watchdog (stall timeout out of reach): the
  peer's collective times out after `--collective-timeout-s` (120 s: the
  value the launch used to inherit), then the launch is torn down;
- candidate: the same with the step-progress watchdog at `--stall-timeout-s`.

The sides alternate; medians are reported. A killed rank needs no watchdog
(torchrun sees the exit within its 0.5 s monitor interval): its time to fail
is reported beside the candidate. Lower is better.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from infra.launch.launcher import LaunchError
from tasks.plan import plan_run_fn
from tasks.segment import train_segment_fn
from tests.conftest import tiny_tree
from trainer_core.config import config_from_dict
from trainer_core.run.faults import FAULT_ENV, FAULT_KIND_ENV


def _time_to_fail(work: Path, kind: str, stall_timeout_s: float, collective_timeout_s: float, label: str) -> float:
    run = work / label
    config = config_from_dict(
        tiny_tree(
            run,
            train={
                "steps": 3,
                "steps_per_segment": 3,
                "stall_timeout_s": stall_timeout_s,
                "collective_timeout_s": collective_timeout_s,
            },
        ),
        config_dir=run,
    )
    planned = plan_run_fn(config)
    marker = run / "fault"
    os.environ[FAULT_ENV], os.environ[FAULT_KIND_ENV] = f"1:1:{marker}", kind
    try:
        train_segment_fn(planned, 0, on_line=lambda _: None)
    except LaunchError as error:
        elapsed = time.time() - marker.stat().st_mtime
        print(f"{label}: {error.failure.headline()} after {elapsed:.1f} s", flush=True)
        return elapsed
    finally:
        del os.environ[FAULT_ENV], os.environ[FAULT_KIND_ENV]
    raise RuntimeError(f"{label}: the injected fault did not fail the segment")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--stall-timeout-s", type=float, default=10.0)
    parser.add_argument("--collective-timeout-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="rankflow-bench-ttf-"))
    baseline, candidate, killed = [], [], []
    for repetition in range(args.repetitions):
        baseline.append(_time_to_fail(work, "stop", 1e9, args.collective_timeout_s, f"baseline-stop-{repetition}"))
        candidate.append(_time_to_fail(work, "stop", args.stall_timeout_s, 600.0, f"candidate-stop-{repetition}"))
        killed.append(_time_to_fail(work, "kill", args.stall_timeout_s, 600.0, f"candidate-kill-{repetition}"))
    base, cand = statistics.median(baseline), statistics.median(candidate)
    print(
        json.dumps(
            {
                "bench": "time_to_fail",
                "baseline": {
                    "stopped_rank_s": round(base, 2),
                    "watchdog": False,
                    "collective_timeout_s": args.collective_timeout_s,
                },
                "candidate": {
                    "stopped_rank_s": round(cand, 2),
                    "watchdog": True,
                    "stall_timeout_s": args.stall_timeout_s,
                    "killed_rank_s": round(statistics.median(killed), 2),
                },
                "ratio": round(cand / base, 4),
                "higher_is_better": False,
                "repetitions": args.repetitions,
            }
        )
    )


if __name__ == "__main__":
    main()
