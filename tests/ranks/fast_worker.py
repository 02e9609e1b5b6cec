"""Run under torchrun by test_logical_ranks: the SPMD SFT run with `reduction="fast"` (a plain all-reduce)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tests.ranks.loops import LOGICAL_DP, digest, make_trainer, sft_batches, spmd_sft
from trainer_core.distributed import init_distributed, run_rank_main
from trainer_core.ranks import pin_threads


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    pin_threads(1)
    topology = init_distributed(logical_dp=LOGICAL_DP, timeout_s=120)
    trainer = make_trainer()
    losses = spmd_sft(trainer, topology, sft_batches((8, 8, 8)), reduction="fast")
    if topology.rank == 0:
        (args.out / "fast.json").write_text(json.dumps({"losses": losses, "digest": digest(trainer)}))


if __name__ == "__main__":
    run_rank_main(main)
