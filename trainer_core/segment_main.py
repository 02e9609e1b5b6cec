"""Entry point of one training segment, run by torchrun on every rank.

    python -m torch.distributed.run … -m trainer_core.segment_main --run-dir D --segment K

Resumes from segment K-1's state (or initialises the model), trains the
segment's optimizer steps through the trainer API (SFT, or the clipped policy
gradient for RL data) over the logical data-parallel ranks this rank owns,
saves the state, and writes the segment's result JSON (rank 0).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch

from .config import RunConfig
from .data.pack import packed_attention_inputs
from .distributed import Topology, all_reduce_sum_, init_distributed, log, run_rank_main
from .faults import maybe_inject_fault, nonfinite_loss_factor
from .files import write_text_atomic
from .model import build_trainer
from .objectives import clipped_policy_gradient_sum, sft_loss_sum, stale_trajectory_mask
from .plan import load_segment_shard, read_plan
from .progress import ProgressWriter, progress_path
from .schedule import learning_rate_at
from .state import load_training_state, save_training_state, state_dir_for
from .training import MissReports, Trainer


def step_seed(seed: int, step: int, logical_rank: int) -> int:
    """A seed per (run, step, logical rank): dropout does not depend on the world size."""
    digest = hashlib.sha256(f"{seed}:{step}:{logical_rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def segment_result_path(run_dir: Path, segment_index: int) -> Path:
    return run_dir / "segments" / f"segment-{segment_index:04d}.json"


def planner_reports_dir(run_dir: Path) -> Path:
    """Where the memory planner's miss reports go (`segment-NNNN-rank-R-miss-NNN.json`, bounded per rank)."""
    return run_dir / "planner"


def _count_documents(selected: torch.Tensor, rows: dict[str, torch.Tensor]) -> int:
    """Documents with any selected target token (a packed row holds several)."""
    if "document_ids" not in rows:
        return int(selected.any(dim=1).sum())
    documents = rows["document_ids"][:, 1:].long()
    row_index = torch.arange(documents.shape[0])[:, None].expand_as(documents)
    keys = (row_index * (int(documents.max()) + 1) + documents)[selected]
    return int(keys.unique().numel())


def _micro_batch_loss_sum(config: RunConfig, logprobs: torch.Tensor, rows: dict[str, torch.Tensor], version: int,
                          rl_sums: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The loss sum of one logical rank's rows, and how many trajectories were dropped as stale.

    For RL, adds to `rl_sums` the clipped-token count, the importance-ratio sum and the token count.

    Shard tensors are aligned per target token t; `logprobs[:, t-1]` is the
    logprob of target t, hence the `[:, 1:]` slices.
    """
    loss_mask = rows["loss_mask"][:, 1:]
    if config.data.kind == "sft":
        return sft_loss_sum(logprobs, loss_mask), 0
    num_stale = 0
    mask = loss_mask
    if config.rl.max_data_staleness is not None:
        keep, num_stale_tokens = stale_trajectory_mask(
            rows["policy_version"][:, 1:], version, config.rl.max_data_staleness, config.rl.stale_trajectories, valid=loss_mask)
        if num_stale_tokens:
            num_stale = _count_documents(loss_mask & ~keep, rows)
            mask = loss_mask & keep
    loss, stats = clipped_policy_gradient_sum(
        logprobs, rows["behaviour_logprobs"][:, 1:], rows["advantages"][:, 1:], mask,
        clip_low=config.rl.clip_low, clip_high=config.rl.clip_high,
    )
    num_tokens = float(mask.sum())
    rl_sums += torch.tensor([stats.clipped_fraction * num_tokens, stats.mean_ratio * num_tokens, num_tokens])
    if config.rl.sft_coef:
        loss = loss + config.rl.sft_coef * sft_loss_sum(logprobs, mask)
    return loss, num_stale


def _step_figures(step: int, loss: float, report, learning_rate: float, sums: torch.Tensor, step_s: float, rl: bool) -> dict:
    """One step's live figures (global: `sums` is already reduced over ranks)."""
    tokens, stale, clipped, ratio_sum, rl_tokens = (float(x) for x in sums)
    figures = {"step": step, "loss": loss, "grad_norm": float(report.grad_norm), "learning_rate": learning_rate,
               "stepped": bool(report.stepped), "tokens": int(tokens), "step_s": step_s,
               "tokens_per_s": tokens / step_s if step_s > 0 else 0.0}
    if rl:  # fractions over the loss tokens kept; None when the step kept none (all stale)
        figures.update(stale_trajectories_dropped=int(stale), clip_fraction=clipped / rl_tokens if rl_tokens else None,
                       mean_importance_ratio=ratio_sum / rl_tokens if rl_tokens else None)
    return figures


def _forward(trainer: Trainer, rows: dict[str, torch.Tensor], mode):
    if "position_ids" not in rows:
        return trainer.forward(rows["input_ids"], rows["attention_mask"], mode=mode)
    # Packed rows: no 2D attention mask (documents would see each other); the
    # model builds per-document causal attention from the restarting positions.
    packed = packed_attention_inputs(rows["input_ids"], rows["position_ids"], rows["document_ids"])
    return trainer.forward(packed["input_ids"], packed.get("attention_mask"), position_ids=packed["position_ids"], mode=mode)


def train_segment(run_dir: Path, segment_index: int) -> None:
    started = time.perf_counter()
    plan = read_plan(run_dir)
    config = plan.run_config()
    segment = plan.segments[segment_index]
    topology: Topology = init_distributed(config.train.logical_dp, config.train.collective_timeout_s)

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
    shard = load_segment_shard(run_dir, segment)
    setup_s = time.perf_counter() - started
    log(f"segment {segment_index}: steps {segment.start_step}..{segment.end_step - 1}, "
        f"{topology.world_size} rank(s) x {topology.logical_per_rank} logical, setup {setup_s:.2f}s")
    progress = ProgressWriter(progress_path(run_dir, segment_index), rank=topology.rank)
    progress.write("ready", segment=segment_index, start_step=segment.start_step, end_step=segment.end_step,
                   total_steps=plan.segments[-1].end_step, setup_s=setup_s)

    mode = None if config.train.backward_mode == "auto" else config.train.backward_mode
    per_logical = config.train.global_batch_size // topology.logical_dp
    losses, grad_norms, skipped = [], [], []
    num_input_tokens = num_stale = 0
    train_started = time.perf_counter()
    for local_step in range(segment.num_steps):
        step = segment.start_step + local_step
        maybe_inject_fault(step, topology.rank)
        batch = {name: tensor[local_step] for name, tensor in shard.items()}
        num_loss_tokens = int(batch["loss_mask"][:, 1:].sum())
        version = config.rl.initial_policy_version + base.revision
        loss_sum = torch.zeros(())
        step_started = time.perf_counter()
        step_sums = torch.zeros(5)  # input tokens, stale trajectories, clipped tokens, ratio sum, RL tokens
        for logical_rank in topology.local_logical_ranks:
            rows = {name: tensor[logical_rank * per_logical:(logical_rank + 1) * per_logical] for name, tensor in batch.items()}
            torch.manual_seed(step_seed(config.run.seed, step, logical_rank))
            out = _forward(trainer, rows, mode)
            micro_loss, micro_stale = _micro_batch_loss_sum(config, out.logprobs, rows, version, step_sums[2:])
            micro_loss = micro_loss * nonfinite_loss_factor(step, topology.rank)
            trainer.backward(micro_loss / num_loss_tokens)
            loss_sum += micro_loss.detach()
            num_stale += micro_stale
            num_input_tokens += int(rows["attention_mask"].sum())
            step_sums[0] += float(rows["attention_mask"].sum())
            step_sums[1] += micro_stale
        all_reduce_sum_([loss_sum, step_sums])
        learning_rate = learning_rate_at(step, config.train)
        report = trainer.step(learning_rate=learning_rate)[base.name]
        loss = float(loss_sum) / num_loss_tokens
        losses.append(loss)
        grad_norms.append(report.grad_norm)
        if not report.stepped and report.skipped_reason == "no gradient":
            skipped.append(step)
            log(f"step {step}: no gradient on any rank (every loss token masked); nothing to update")
        elif not report.stepped:
            # Every rank holds the same reduced norm, so every rank takes this branch alike.
            if config.train.nonfinite == "error":
                raise RuntimeError(f"step {step}: non-finite gradient norm {report.grad_norm} ({report.skipped_reason}); "
                                   "failing the segment as train.nonfinite = 'error' asks — set it to 'skip' to skip "
                                   "such updates instead")
            skipped.append(step)
            log(f"step {step}: non-finite gradient norm {report.grad_norm}; update skipped on every rank")
        if topology.rank == 0:
            log(f"step {step} loss {loss:.4f} grad_norm {report.grad_norm:.3f}")
        progress.write("step", **_step_figures(step, loss, report, learning_rate, step_sums, time.perf_counter() - step_started,
                                               rl=config.data.kind == "rl"))
    train_s = time.perf_counter() - train_started
    totals = torch.tensor([float(num_input_tokens), float(num_stale)])
    all_reduce_sum_([totals])
    planner_misses = torch.tensor([float(trainer.planner.num_misses)])
    all_reduce_sum_([planner_misses])

    state_dir = state_dir_for(run_dir, segment_index)
    save_started = time.perf_counter()
    progress.write("saving", segment=segment_index)
    state_bytes = 0
    if topology.rank == 0:
        state_bytes = save_training_state(
            state_dir, trainer.checkpoints, {"next_step": segment.end_step, "segment": segment_index, "plan_digest": plan.digest},
        )
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    save_s = time.perf_counter() - save_started
    progress.write("saved", segment=segment_index, save_s=save_s)
    progress.close()
    if topology.rank == 0:
        tokens = int(totals[0].item())
        result = {
            "segment": segment_index, "start_step": segment.start_step, "end_step": segment.end_step,
            "losses": losses, "grad_norms": grad_norms, "skipped_steps": skipped, "num_skipped_steps": len(skipped),
            "num_stale_trajectories": int(totals[1].item()),
            "num_tokens": tokens, "tokens_per_s": tokens / train_s if train_s > 0 else 0.0,
            "setup_s": setup_s, "train_s": train_s, "save_s": save_s,
            "peak_saved_bytes": trainer.peak_saved_bytes,
            "planner_misses": int(planner_misses.item()), "planner": trainer.planner.summary(),
            "world_size": topology.world_size, "logical_dp": topology.logical_dp,
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
