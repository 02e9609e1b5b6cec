"""Entry point of the export stage, run by torchrun on every rank.

    python -m torch.distributed.run … -m trainer_core.export_main --run-dir D --segment K --out DIR

Every rank loads segment K's state and checks that its weights agree with every
other rank's (a diverged replica must not be published); rank 0 writes the
checkpoint. The weight digests travel in a status exchange
(`trainer_core.ranks.exchange`): a rank that fails to load fails every rank at
once, with its rank and error named. A staged directory whose manifest still verifies is kept as it is:
a retried export does not serialize the same checkpoint again.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch.distributed as dist

from .distributed import init_distributed, log, run_rank_main
from .ranks import exchange
from .export import export_checkpoint
from .faults import maybe_inject_export_fault
from .files import tensors_sha256, write_text_atomic
from .manifest import verify_staged
from .model import build_trainer
from .plan import read_plan
from .state import load_training_state, state_dir_for


def export_segment(run_dir: Path, segment_index: int, out_dir: Path) -> None:
    started = time.perf_counter()
    plan = read_plan(run_dir)
    config = plan.run_config()
    topology = init_distributed(config.train.logical_dp, config.train.collective_timeout_s,
                                config.train.global_batch_size)
    error = digest = None
    try:
        trainer = build_trainer(config)
        model = trainer.model
        meta = load_training_state(state_dir_for(run_dir, segment_index), trainer.checkpoints, with_optimizer=False)
        maybe_inject_export_fault(topology.rank)
        digest = tensors_sha256(model.state_dict())
    except Exception as failure:  # noqa: BLE001 - every rank hears of it in the exchange, then raises
        error = failure
    digests = exchange("export", error, digest)
    disagreeing = [r for r, d in enumerate(digests) if d != digests[0]]
    if disagreeing:
        raise RuntimeError(f"ranks {disagreeing} hold weights that differ from rank 0's; refusing to export")
    step = meta["next_step"]
    reused = False
    if topology.rank == 0:
        staged = verify_staged(out_dir)
        reused = staged is not None and staged.get("weights_sha256") == digest
        if not reused:
            export_checkpoint(config, model, out_dir, {"run_id": plan.run_id, "step": step, "weights_sha256": digest})
        result = {"segment": segment_index, "step": step, "out_dir": str(out_dir), "reused": reused,
                  "weights_sha256": digest, "export_s": time.perf_counter() - started}
        write_text_atomic(out_dir.parent / f"{out_dir.name}.result.json", json.dumps(result, indent=2))
        log(f"export of step {step} {'reused (manifest verifies)' if reused else 'written'} at {out_dir}")
    if dist.is_initialized():
        dist.barrier()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--segment", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    run_rank_main(lambda: export_segment(args.run_dir, args.segment, args.out))


if __name__ == "__main__":
    main()
