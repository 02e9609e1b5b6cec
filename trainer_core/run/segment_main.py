"""Entry point of one training segment, run by torchrun on every rank.

    python -m torch.distributed.run … -m trainer_core.run.segment_main --run-dir D --segment K

Resumes from segment K-1's state (or initialises the model), trains the
segment's optimizer steps through the trainer API with the configured
objective (`train.objective`: SFT, or the clipped policy gradient for RL data)
over the logical data-parallel ranks this rank owns
(`trainer_core.ranks.LogicalDataParallel`: per-logical-rank gradients folded in
logical order, losses and counts reduced the same way, threads pinned), saves
the state, and writes the segment's result (rank 0, `SegmentResult`). With
`train.reduction = "deterministic"` every figure and weight is bitwise the same
at any number of processes, so a segment may resume a state saved at another.
The steps themselves are `trainer_core.run.segment.SegmentRun`'s.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from trainer_core.ranks import step_seed
from trainer_core.run.distributed import run_rank_main
from trainer_core.run.rank_process import leave_now
from trainer_core.run.segment import SegmentRun, planner_reports_dir, segment_result_path

__all__ = ["main", "planner_reports_dir", "segment_result_path", "step_seed", "train_segment"]


def train_segment(run_dir: Path, segment_index: int) -> None:
    run = SegmentRun.set_up(run_dir, segment_index)
    steps = run.train_steps()
    saved = run.save_state()
    run.write_result(steps, saved)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--segment", type=int, required=True)
    args = parser.parse_args(argv)
    run_rank_main(lambda: train_segment(args.run_dir, args.segment))
    if argv is None:  # the rank process itself: the state and the result are written, the process group is gone
        leave_now(0)


if __name__ == "__main__":
    main()
