"""Entry point of one training segment, run by torchrun on every rank.

    python -m torch.distributed.run … -m trainer_core.segment_main --run-dir D --segment K

Resumes from segment K-1's state (or initialises the model), trains the
segment's optimizer steps through the trainer API (SFT, or the clipped policy
gradient for RL data) over the logical data-parallel ranks this rank owns
(`trainer_core.ranks.LogicalDataParallel`: per-logical-rank gradients folded in
logical order, losses and counts reduced the same way, threads pinned), saves
the state, and writes the segment's result JSON (rank 0). With
`train.reduction = "deterministic"` every figure and weight is bitwise the same
at any number of processes, so a segment may resume a state saved at another.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from .config import RunConfig
from .data.pack import packed_attention_inputs
from .distributed import Topology, init_distributed, log, run_rank_main
from .training.gradient_reduction import all_reduce_sum_
from .faults import maybe_inject_fault, nonfinite_loss_factor
from .files import write_text_atomic
from .model import build_trainer
from .objectives import Objective, objective_for
from .plan import load_segment_shard, read_plan
from .progress import ProgressWriter, progress_path
from .run.figures import FigureLayout
from .ranks import LogicalDataParallel, pin_threads, step_seed, threads_for
from .schedule import learning_rate_at
from .state import load_training_state, save_training_state, state_dir_for
from .training import MissReports, Trainer


__all__ = ["main", "segment_result_path", "step_seed", "train_segment"]


def segment_result_path(run_dir: Path, segment_index: int) -> Path:
    return run_dir / "segments" / f"segment-{segment_index:04d}.json"


def planner_reports_dir(run_dir: Path) -> Path:
    """Where the memory planner's miss reports go (`segment-NNNN-rank-R-miss-NNN.json`, bounded per rank)."""
    return run_dir / "planner"


def _step_figures(step: int, loss: float, report, learning_rate: float, sums: dict[str, float], step_s: float,
                  objective: Objective) -> dict:
    """One step's live figures (global: `sums` is already reduced over ranks), the objective's last."""
    tokens = sums["input_tokens"]
    figures = {"step": step, "loss": loss, "grad_norm": float(report.grad_norm), "learning_rate": learning_rate,
               "stepped": bool(report.stepped), "tokens": int(tokens), "step_s": step_s,
               "tokens_per_s": tokens / step_s if step_s > 0 else 0.0}
    figures.update(objective.step_figures(sums))
    return figures


def _forward(trainer: Trainer, rows: dict[str, torch.Tensor], mode):
    if "position_ids" not in rows:
        return trainer.forward(rows["input_ids"], rows["attention_mask"], mode=mode)
    # Packed rows: no 2D attention mask (documents would see each other); the
    # model builds per-document causal attention from the restarting positions.
    packed = packed_attention_inputs(rows["input_ids"], rows["position_ids"], rows["document_ids"])
    return trainer.forward(packed["input_ids"], packed.get("attention_mask"), position_ids=packed["position_ids"], mode=mode)


def _logical_rank_work(objective: Objective, layout: FigureLayout, trainer: Trainer, rows: dict[str, torch.Tensor],
                       *, step: int, rank: int, revision: int, num_loss_tokens: int, mode) -> torch.Tensor:
    """Forward and backward of one logical rank's rows; returns its figures, packed by `layout`."""
    out = _forward(trainer, rows, mode)
    part = objective.loss_sum(out.logprobs, rows, revision=revision)
    micro_loss = part.loss * nonfinite_loss_factor(step, rank)
    # Normalised by the loss tokens of the whole global batch: the same loss at any split.
    trainer.backward(micro_loss / num_loss_tokens)
    return layout.pack({"loss_sum": micro_loss.detach().double(), "input_tokens": float(rows["attention_mask"].sum()),
                        "stale_trajectories": float(part.num_dropped), **part.figures})


def _train_step(ldp: LogicalDataParallel, objective: Objective, layout: FigureLayout, batch: dict[str, torch.Tensor],
                step: int, revision: int, mode) -> dict[str, float]:
    """One optimizer step's forwards and backwards over this rank's logical ranks; returns the global figures."""
    num_loss_tokens = int(batch["loss_mask"][:, 1:].sum())
    rank = ldp.topology.rank
    figures: dict[int, torch.Tensor] = {}
    for shard in ldp.forward_batches(batch, step=step):
        with shard:  # one command: a failure here, on any rank, stops every rank with the rank named
            if shard.logical_rank == ldp.topology.local_logical_ranks[0]:
                maybe_inject_fault(step, rank)
            if not shard.empty:
                figures[shard.logical_rank] = _logical_rank_work(
                    objective, layout, ldp.trainer, shard.rows, step=step, rank=rank, revision=revision,
                    num_loss_tokens=num_loss_tokens, mode=mode)
    return layout.unpack(ldp.reduce(figures, "sum"))


def _note_skipped(config: RunConfig, step: int, report, skipped: list[int]) -> None:
    if report.stepped:
        return
    if report.skipped_reason == "no gradient":
        skipped.append(step)
        log(f"step {step}: no gradient on any rank (every loss token masked); nothing to update")
        return
    # Every rank holds the same reduced norm, so every rank takes this branch alike.
    if config.train.nonfinite == "error":
        raise RuntimeError(f"step {step}: non-finite gradient norm {report.grad_norm} ({report.skipped_reason}); "
                           "failing the segment as train.nonfinite = 'error' asks — set it to 'skip' to skip "
                           "such updates instead")
    skipped.append(step)
    log(f"step {step}: non-finite gradient norm {report.grad_norm}; update skipped on every rank")


def train_segment(run_dir: Path, segment_index: int) -> None:
    started = time.perf_counter()
    plan = read_plan(run_dir)
    config = plan.run_config()
    segment = plan.segments[segment_index]
    # Before any compute: the thread count decides the last bits of every kernel's reductions.
    num_threads = pin_threads(threads_for(config.train.reduction, config.train.threads_per_process))
    topology: Topology = init_distributed(config.train.logical_dp, config.train.collective_timeout_s,
                                          config.train.global_batch_size)

    trainer = build_trainer(config, miss_reports=MissReports(
        planner_reports_dir(run_dir), prefix=f"segment-{segment_index:04d}-rank-{topology.rank}-"))
    (base,) = trainer.checkpoints.values()  # the full model, or the LoRA adapter
    if segment_index > 0:
        meta = load_training_state(state_dir_for(run_dir, segment_index - 1), trainer.checkpoints)
        if meta["next_step"] != segment.start_step:
            raise RuntimeError(
                f"state of segment {segment_index - 1} ends at step {meta['next_step']}, but segment "
                f"{segment_index} starts at {segment.start_step}; the run directory mixes plans — start a new run"
            )
    trainer.model.train()
    ldp = LogicalDataParallel(trainer, topology, reduction=config.train.reduction, seed=config.run.seed)
    shard = load_segment_shard(run_dir, segment)
    objective = objective_for(config)
    layout = FigureLayout.for_objective(objective.figures)
    setup_s = time.perf_counter() - started
    log(f"segment {segment_index}: steps {segment.start_step}..{segment.end_step - 1}, "
        f"{topology.world_size} rank(s) x {topology.logical_per_rank} logical, {config.train.reduction} reduction, "
        f"{num_threads} thread(s) per rank, setup {setup_s:.2f}s")
    progress = ProgressWriter(progress_path(run_dir, segment_index), rank=topology.rank)
    progress.write("ready", segment=segment_index, start_step=segment.start_step, end_step=segment.end_step,
                   total_steps=plan.segments[-1].end_step, setup_s=setup_s,
                   objective=objective.name)

    mode = None if config.train.backward_mode == "auto" else config.train.backward_mode
    losses, grad_norms, skipped = [], [], []
    num_input_tokens = num_stale = 0
    train_started = time.perf_counter()
    for local_step in range(segment.num_steps):
        step = segment.start_step + local_step
        batch = {name: tensor[local_step] for name, tensor in shard.items()}
        step_started = time.perf_counter()
        sums = _train_step(ldp, objective, layout, batch, step, base.revision, mode)
        learning_rate = learning_rate_at(step, config.train)
        report = ldp.step(learning_rate=learning_rate)[base.name]
        loss = sums["loss_sum"] / int(batch["loss_mask"][:, 1:].sum())
        losses.append(loss)
        grad_norms.append(report.grad_norm)
        num_input_tokens += int(sums["input_tokens"])
        num_stale += int(sums["stale_trajectories"])
        _note_skipped(config, step, report, skipped)
        if topology.rank == 0:
            log(f"step {step} loss {loss:.4f} grad_norm {report.grad_norm:.3f}")
        progress.write("step", **_step_figures(step, loss, report, learning_rate, sums, time.perf_counter() - step_started,
                                               objective))
    train_s = time.perf_counter() - train_started
    planner_misses = torch.tensor([float(trainer.planner.num_misses)])
    all_reduce_sum_([planner_misses])  # every rank's planner decides for its own graphs

    state_dir = state_dir_for(run_dir, segment_index)
    save_started = time.perf_counter()
    progress.write("saving", segment=segment_index)
    state_bytes = 0
    with ldp.command("save"):  # every rank waits for rank 0's write, and hears if it failed
        if topology.rank == 0:
            state_bytes = save_training_state(
                state_dir, trainer.checkpoints, {"next_step": segment.end_step, "segment": segment_index, "plan_digest": plan.digest},
            )
    save_s = time.perf_counter() - save_started
    progress.write("saved", segment=segment_index, save_s=save_s)
    progress.close()
    if topology.rank == 0:
        result = {
            "segment": segment_index, "start_step": segment.start_step, "end_step": segment.end_step,
            "losses": losses, "grad_norms": grad_norms, "skipped_steps": skipped, "num_skipped_steps": len(skipped),
            "num_stale_trajectories": num_stale,
            "num_tokens": num_input_tokens, "tokens_per_s": num_input_tokens / train_s if train_s > 0 else 0.0,
            "setup_s": setup_s, "train_s": train_s, "save_s": save_s,
            "peak_saved_bytes": trainer.peak_saved_bytes,
            "planner_misses": int(planner_misses.item()), "planner": trainer.planner.summary(),
            "world_size": topology.world_size, "logical_dp": topology.logical_dp,
            "reduction": config.train.reduction, "threads_per_process": num_threads,
            "state_dir": str(state_dir), "state_bytes": state_bytes,
        }
        write_text_atomic(segment_result_path(run_dir, segment_index), json.dumps(result, indent=2))
        log(f"segment {segment_index} done: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
            f"{result['tokens_per_s']:.0f} tokens/s, state {state_bytes} bytes")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--segment", type=int, required=True)
    args = parser.parse_args(argv)
    run_rank_main(lambda: train_segment(args.run_dir, args.segment))


if __name__ == "__main__":
    main()
