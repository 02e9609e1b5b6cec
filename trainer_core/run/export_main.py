"""Entry point of the export stage, run by torchrun on every rank.

    python -m torch.distributed.run … -m trainer_core.run.export_main --run-dir D --segment K --out DIR

Every rank loads segment K's state (a rank that fails to load fails every rank
at once, through `trainer_core.ranks.exchange`, with its rank and error named)
and takes part in preparing the checkpoint (trainer_core/run/export_prepare.py; from the shards,
rank by rank, when the model is sharded): if
any rank fails, every rank aborts and the error names the failing rank. A
staged directory whose manifest still verifies with the same weights is kept as
it is: a retried export does not serialize the same checkpoint again. The
manifest carries the checkpoint's provenance (format rankflow-checkpoint/2).
Rank 0 records its progress (`trainer_core.run.progress`: ready, each phase,
exported), so the stall watchdog ends an export whose rank hangs.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch.distributed as dist

from trainer_core.config import RunConfig
from trainer_core.model import build_trainer
from trainer_core.ranks import exchange
from trainer_core.run.distributed import init_distributed, log, run_rank_main, training_mesh
from trainer_core.run.export_prepare import prepare_export
from trainer_core.run.faults import maybe_inject_export_fault
from trainer_core.run.manifest import checkpoint_name
from trainer_core.run.plan import Plan, read_plan
from trainer_core.run.progress import ProgressWriter, export_progress_path
from trainer_core.run.rank_process import leave_now
from trainer_core.run.records import ExportResult, StateMeta, export_result_path
from trainer_core.run.state import load_training_state, state_dir_for


def parent_checkpoint(plan: Plan, config: RunConfig, segment_index: int) -> str | None:
    """The checkpoint exported before this one in the run (its weights' ancestor), if any."""
    earlier = [i for i in range(segment_index) if config.export_after_segment(i)]
    return checkpoint_name(plan.segments[earlier[-1]].end_step) if earlier else None


def export_segment(run_dir: Path, segment_index: int, out_dir: Path) -> None:
    started = time.perf_counter()
    plan = read_plan(run_dir)
    config = plan.run_config()  # validated once per launch: the rest of the export is handed this one
    topology = init_distributed(
        config.train.logical_dp, config.train.collective_timeout_s, config.train.global_batch_size
    )
    progress = ProgressWriter(export_progress_path(run_dir, segment_index), rank=topology.rank)
    try:
        _export(run_dir, segment_index, out_dir, plan, config, topology, progress, started)
    finally:
        progress.close()


def _export(
    run_dir: Path,
    segment_index: int,
    out_dir: Path,
    plan: Plan,
    config: RunConfig,
    topology,
    progress: ProgressWriter,
    started: float,
) -> None:
    error = trainer = meta = None
    try:
        mesh = training_mesh(topology) if config.train.shards_weights else None
        # The state loaded next writes every weight of a full fine-tune: its random initialisation is skipped.
        trainer = build_trainer(config, mesh=mesh, weights_from_state=True)
        meta = load_training_state(state_dir_for(run_dir, segment_index), trainer.checkpoints, with_optimizer=False)
    except Exception as failure:  # noqa: BLE001 - every rank hears of it in the exchange, then raises
        error = failure
    exchange("export", error)
    assert trainer is not None  # a rank whose build failed made the exchange raise on every rank
    progress.write("ready")
    step = StateMeta.model_validate(meta).next_step
    provenance = {
        "run_id": plan.run_id,
        "step": step,
        "plan_digest": plan.digest,
        "parent_checkpoint": parent_checkpoint(plan, config, segment_index),
        "base_model": config.model.path or config.model.config,
        "world_size": topology.world_size,
        "logical_dp": config.train.logical_dp,
    }

    def at_phase(rank: int, phase: str) -> None:
        progress.write("phase", phase=phase)  # each phase ends in an exchange: a hung rank stops the records
        if phase == "weights":
            maybe_inject_export_fault(rank)

    prepared = prepare_export(topology, config, trainer, out_dir, provenance, at_phase)
    if topology.rank == 0:
        ExportResult(
            segment=segment_index,
            step=step,
            out_dir=str(out_dir),
            reused=prepared["reused"],
            weights_sha256=prepared["weights_sha256"],
            export_s=time.perf_counter() - started,
        ).write(export_result_path(out_dir))
        log(f"export of step {step} {'reused (manifest verifies)' if prepared['reused'] else 'written'} at {out_dir}")
    progress.write("exported")
    if dist.is_initialized():
        dist.barrier()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--segment", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    run_rank_main(lambda: export_segment(args.run_dir, args.segment, args.out))
    if argv is None:  # the rank process itself: the staging and the result are written, the group is gone
        leave_now(0)


if __name__ == "__main__":
    main()
