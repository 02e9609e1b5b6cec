"""Entry point of one training segment, run by torchrun on every rank.

    python -m torch.distributed.run … -m trainer_core.segment_main --run-dir D --segment K

Resumes from segment K-1's state (or initialises the model), trains the
segment's optimizer steps with SFT over the logical data-parallel ranks this
rank owns, saves the state, and writes the segment's result JSON (rank 0).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch

from .distributed import Topology, all_reduce_sum_, init_distributed, log, run_rank_main
from .faults import maybe_inject_fault
from .model import build_model
from .optim import build_optimizer, clip_and_step
from .plan import load_segment_shard, read_plan
from .sft import token_loss_sum
from .state import load_training_state, save_training_state, state_dir_for


def step_seed(seed: int, step: int, logical_rank: int) -> int:
    """A seed per (run, step, logical rank): dropout does not depend on the world size."""
    digest = hashlib.sha256(f"{seed}:{step}:{logical_rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def segment_result_path(run_dir: Path, segment_index: int) -> Path:
    return run_dir / "segments" / f"segment-{segment_index:04d}.json"


def train_segment(run_dir: Path, segment_index: int) -> None:
    started = time.perf_counter()
    plan = read_plan(run_dir)
    config = plan.run_config()
    segment = plan.segments[segment_index]
    topology: Topology = init_distributed(config.train.logical_dp)

    model = build_model(config)
    optimizer = build_optimizer(model, config.train)
    if segment_index > 0:
        meta = load_training_state(state_dir_for(run_dir, segment_index - 1), model, optimizer)
        if meta["next_step"] != segment.start_step:
            raise RuntimeError(
                f"state of segment {segment_index - 1} ends at step {meta['next_step']}, but segment "
                f"{segment_index} starts at {segment.start_step}; the run directory mixes plans — start a new run"
            )
    model.train()
    shard = load_segment_shard(run_dir, segment)
    setup_s = time.perf_counter() - started
    log(f"segment {segment_index}: steps {segment.start_step}..{segment.end_step - 1}, "
        f"{topology.world_size} rank(s) x {topology.logical_per_rank} logical, setup {setup_s:.2f}s")

    per_logical = config.train.global_batch_size // topology.logical_dp
    losses, grad_norms, skipped = [], [], []
    num_input_tokens = 0
    train_started = time.perf_counter()
    for local_step in range(segment.num_steps):
        step = segment.start_step + local_step
        maybe_inject_fault(step, topology.rank)
        input_ids, attention_mask, loss_mask = (shard[k][local_step] for k in ("input_ids", "attention_mask", "loss_mask"))
        num_loss_tokens = int(loss_mask[:, 1:].sum())
        loss_sum = torch.zeros(())
        for logical_rank in topology.local_logical_ranks:
            rows = slice(logical_rank * per_logical, (logical_rank + 1) * per_logical)
            torch.manual_seed(step_seed(config.run.seed, step, logical_rank))
            micro_loss = token_loss_sum(model, input_ids[rows], attention_mask[rows], loss_mask[rows])
            (micro_loss / num_loss_tokens).backward()
            loss_sum += micro_loss.detach()
            num_input_tokens += int(attention_mask[rows].sum())
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        all_reduce_sum_(grads + [loss_sum])
        norm, stepped = clip_and_step(optimizer, step, config.train)
        loss = float(loss_sum) / num_loss_tokens
        losses.append(loss)
        grad_norms.append(norm)
        if not stepped:
            skipped.append(step)
            log(f"step {step}: non-finite gradient norm {norm}; update skipped on every rank")
        if topology.rank == 0:
            log(f"step {step} loss {loss:.4f} grad_norm {norm:.3f}")
    train_s = time.perf_counter() - train_started
    num_input_tokens_all = torch.tensor([float(num_input_tokens)])
    all_reduce_sum_([num_input_tokens_all])

    state_dir = state_dir_for(run_dir, segment_index)
    save_started = time.perf_counter()
    state_bytes = 0
    if topology.rank == 0:
        state_bytes = save_training_state(
            state_dir, model, optimizer,
            {"next_step": segment.end_step, "segment": segment_index, "plan_digest": plan.digest},
        )
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    save_s = time.perf_counter() - save_started
    if topology.rank == 0:
        tokens = int(num_input_tokens_all.item())
        result = {
            "segment": segment_index, "start_step": segment.start_step, "end_step": segment.end_step,
            "losses": losses, "grad_norms": grad_norms, "skipped_steps": skipped,
            "num_tokens": tokens, "tokens_per_s": tokens / train_s if train_s > 0 else 0.0,
            "setup_s": setup_s, "train_s": train_s, "save_s": save_s,
            "world_size": topology.world_size, "logical_dp": topology.logical_dp,
            "state_dir": str(state_dir), "state_bytes": state_bytes,
        }
        path = segment_result_path(run_dir, segment_index)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2))
        os.replace(tmp, path)
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
