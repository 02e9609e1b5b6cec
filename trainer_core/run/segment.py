"""One segment launch on one rank, in named steps: set up, train the steps, save the state, write the result.

    run = SegmentRun.set_up(run_dir, segment_index)  # plan, threads, process group, trainer + resume, shard, objective
    steps = run.train_steps()                        # every optimizer step; progress records as it goes
    saved = run.save_state()                         # rank 0 writes (every rank its shards under fsdp); all hear of a failure
    run.write_result(steps, saved)                   # rank 0: the SegmentResult the task reads

The entry point (`trainer_core.run.segment_main`) runs these in order on every rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer_core.run.distributed import Topology, init_distributed, log, training_mesh
from trainer_core.run.evaluation import evaluate
from trainer_core.run.plan import Plan, SegmentPlan, load_eval_shard, load_segment_shard, read_plan
from trainer_core.run.progress import ProgressWriter, progress_path
from trainer_core.run.sharded_facade import assignment_for, segment_facade
from trainer_core.run.state import (
    load_training_state,
    save_sharded_training_state,
    save_training_state,
    state_dir_for,
)

from ..config import RunConfig
from ..model import build_trainer
from ..objectives import Objective, objective_for
from ..ranks import LogicalDataParallel, pin_threads, threads_for
from ..ranks.coordination import coordinated
from ..training import Checkpoint, MissReports, Trainer
from ..training.gradient_reduction import all_reduce_sum_
from .faults import maybe_inject_command_fault
from .figures import FigureLayout
from .launch_phases import LaunchPhases
from .layout import RunDir
from .records import PlannerSummary, SegmentResult, StateMeta
from .steps import note_skipped, step_figures, train_step


def segment_result_path(run_dir: Path, segment_index: int) -> Path:
    return RunDir(run_dir).result_file(segment_index)


def planner_reports_dir(run_dir: Path) -> Path:
    """Where the memory planner's miss reports go (`segment-NNNN-rank-R-miss-NNN.json`, bounded per rank)."""
    return RunDir(run_dir).planner_dir


@dataclass(frozen=True)
class StepsDone:
    """What the segment's optimizer steps left (every figure global: reduced over ranks)."""

    losses: list[float]
    grad_norms: list[float]
    learning_rates: list[float]
    eval_steps: list[int]
    eval_losses: list[float]
    skipped: list[int]
    num_input_tokens: int
    num_token_slots: int
    """Positions the forwards ran over, padding included (every logical rank)."""
    num_stale: int
    train_s: float
    planner_misses: int


@dataclass(frozen=True)
class SavedState:
    state_dir: Path
    state_bytes: int
    """The state's size on disk (0 on every rank but rank 0, which writes it)."""
    save_s: float


@dataclass
class SegmentRun:
    run_dir: Path
    segment_index: int
    plan: Plan
    config: RunConfig
    segment: SegmentPlan
    topology: Topology
    num_threads: int
    trainer: Trainer
    base: Checkpoint
    """The trained checkpoint: the full model, or the LoRA adapter."""
    ldp: LogicalDataParallel
    shard: dict[str, torch.Tensor]
    eval_rows: dict[str, torch.Tensor] | None
    """The held-out rows ([N, T]), or None for a run without held-out data."""
    objective: Objective
    layout: FigureLayout
    progress: ProgressWriter
    setup_s: float

    @classmethod
    def set_up(cls, run_dir: Path, segment_index: int) -> "SegmentRun":
        """The plan, pinned threads, the process group, the trainer resumed from the previous segment, the shard."""
        started = time.perf_counter()
        phases = LaunchPhases.starting()
        plan = read_plan(run_dir)
        config = plan.run_config()
        segment = plan.segments[segment_index]
        # Before any compute: the thread count decides the last bits of every kernel's reductions.
        num_threads = pin_threads(threads_for(config.train.reduction, config.train.threads_per_process))
        topology: Topology = init_distributed(
            config.train.logical_dp,
            config.train.collective_timeout_s,
            config.train.global_batch_size,
            assignment=assignment_for(config.train.sharding, config.train.reduction),
        )
        phases.mark("process_group")

        trainer = build_trainer(
            config,
            miss_reports=MissReports(
                planner_reports_dir(run_dir), prefix=f"segment-{segment_index:04d}-rank-{topology.rank}-"
            ),
            mesh=training_mesh(topology) if config.train.shards_weights else None,
            weights_from_state=segment_index > 0,  # _resume below writes every weight of a full fine-tune
        )
        (base,) = trainer.checkpoints.values()  # the full model, or the LoRA adapter
        phases.mark("model_built")
        if segment_index > 0:
            _resume(trainer, state_dir_for(run_dir, segment_index - 1), segment)
        phases.mark("state_loaded")
        trainer.model.train()
        ldp = segment_facade(
            trainer,
            topology,
            reduction=config.train.reduction,
            seed=config.run.seed,
            mode=config.train.forward_mode,
        )
        shard = load_segment_shard(run_dir, segment)
        eval_rows = load_eval_shard(run_dir, plan)
        objective = objective_for(config)
        layout = FigureLayout.for_objective(objective.figures)
        phases.mark("shard_loaded")
        setup_s = time.perf_counter() - started
        log(
            f"segment {segment_index}: steps {segment.start_step}..{segment.end_step - 1}, "
            f"{topology.world_size} rank(s) x {topology.logical_per_rank} logical, {config.train.reduction} reduction, "
            f"{num_threads} thread(s) per rank, setup {setup_s:.2f}s"
        )
        progress = ProgressWriter(progress_path(run_dir, segment_index), rank=topology.rank)
        progress.write(
            "ready",
            segment=segment_index,
            start_step=segment.start_step,
            end_step=segment.end_step,
            total_steps=plan.segments[-1].end_step,
            setup_s=setup_s,
            objective=objective.name,
            phases=phases.marks,
        )
        return cls(
            run_dir=run_dir,
            segment_index=segment_index,
            plan=plan,
            config=config,
            segment=segment,
            topology=topology,
            num_threads=num_threads,
            trainer=trainer,
            base=base,
            ldp=ldp,
            shard=shard,
            eval_rows=eval_rows,
            objective=objective,
            layout=layout,
            progress=progress,
            setup_s=setup_s,
        )

    def train_steps(self) -> StepsDone:
        """Every optimizer step of the segment, one progress record each."""
        config, segment, base = self.config, self.segment, self.base
        mode = config.train.forward_mode
        losses, grad_norms, learning_rates, skipped = [], [], [], []
        eval_steps, eval_losses = [], []
        num_input_tokens = num_token_slots = num_stale = 0
        train_started = time.perf_counter()
        for local_step in range(segment.num_steps):
            step = segment.start_step + local_step
            batch = {name: tensor[local_step] for name, tensor in self.shard.items()}
            step_started = time.perf_counter()
            sums = train_step(
                self.ldp, self.objective, self.layout, batch, step, base.revision, mode, config.train.micro_batch_size
            )
            report = self.ldp.step(schedule_step=step)[base.name]  # every checkpoint has the run's schedule
            learning_rate = report.learning_rate
            learning_rates.append(learning_rate)
            loss = sums["loss_sum"] / int(batch["loss_mask"][:, 1:].sum())
            losses.append(loss)
            grad_norms.append(report.grad_norm)
            num_input_tokens += int(sums["input_tokens"])
            num_token_slots += int(sums["token_slots"])
            num_stale += int(sums["stale_trajectories"])
            note_skipped(config, step, report, skipped)
            step_s = time.perf_counter() - step_started
            eval_loss = self.evaluate_after(step)
            if eval_loss is not None:
                eval_steps.append(step)
                eval_losses.append(eval_loss)
            if self.topology.rank == 0:
                evaluated = "" if eval_loss is None else f" eval_loss {eval_loss:.4f}"
                log(f"step {step} loss {loss:.4f} grad_norm {report.grad_norm:.3f}{evaluated}")
            figures = step_figures(step, loss, report, learning_rate, sums, step_s, self.objective)
            self.progress.write("step", **figures, **({} if eval_loss is None else {"eval_loss": eval_loss}))
        train_s = time.perf_counter() - train_started
        planner_misses = torch.tensor([float(self.trainer.planner.num_misses)])
        all_reduce_sum_([planner_misses])  # every rank's planner decides for its own graphs
        return StepsDone(
            losses=losses,
            grad_norms=grad_norms,
            learning_rates=learning_rates,
            eval_steps=eval_steps,
            eval_losses=eval_losses,
            skipped=skipped,
            num_input_tokens=num_input_tokens,
            num_token_slots=num_token_slots,
            num_stale=num_stale,
            train_s=train_s,
            planner_misses=int(planner_misses.item()),
        )

    def evaluate_after(self, step: int) -> float | None:
        """The eval loss after `step` where one is due (every `train.eval_every` steps, and the segment's last step);
        None where not, or without held-out data."""
        every, last = self.config.train.eval_every, step == self.segment.end_step - 1
        if self.eval_rows is None or not (last or (every and (step + 1) % every == 0)):
            return None
        return evaluate(
            self.trainer,
            self.ldp,
            self.objective,
            self.eval_rows,
            revision=self.base.revision,
            rows_per_forward=self.config.train.rows_per_forward,
            loss_tokens=self.plan.eval_loss_tokens,
        )

    def save_state(self) -> SavedState:
        """Rank 0 writes the state; every rank waits for the write, and hears if it failed."""
        state_dir = state_dir_for(self.run_dir, self.segment_index)
        save_started = time.perf_counter()
        self.progress.write("saving", segment=self.segment_index)
        state_bytes = 0
        meta = StateMeta(next_step=self.segment.end_step, segment=self.segment_index, plan_digest=self.plan.digest)
        if self.trainer.parallelism.shards_weights:
            # Every rank writes its shards (collectives inside: a failing rank fails the others' save with it).
            with coordinated("save", collectives=True):
                maybe_inject_command_fault("save", self.topology.rank)
                state_bytes = save_sharded_training_state(
                    state_dir, self.trainer.checkpoints, meta.model_dump(), self.topology.rank
                )
        else:
            with self.ldp.command("save"):
                if self.topology.rank == 0:
                    state_bytes = save_training_state(state_dir, self.trainer.checkpoints, meta.model_dump())
        save_s = time.perf_counter() - save_started
        self.progress.write("saved", segment=self.segment_index, save_s=save_s)
        self.progress.close()
        return SavedState(state_dir=state_dir, state_bytes=state_bytes, save_s=save_s)

    def write_result(self, steps: StepsDone, saved: SavedState) -> None:
        """Rank 0 writes the segment's `SegmentResult`; the other ranks write nothing."""
        if self.topology.rank != 0:
            return
        train_s = steps.train_s
        result = SegmentResult(
            segment=self.segment_index,
            start_step=self.segment.start_step,
            end_step=self.segment.end_step,
            losses=steps.losses,
            grad_norms=steps.grad_norms,
            learning_rates=steps.learning_rates,
            eval_steps=steps.eval_steps,
            eval_losses=steps.eval_losses,
            skipped_steps=steps.skipped,
            num_skipped_steps=len(steps.skipped),
            num_stale_trajectories=steps.num_stale,
            num_tokens=steps.num_input_tokens,
            num_token_slots=steps.num_token_slots,
            tokens_per_s=steps.num_input_tokens / train_s if train_s > 0 else 0.0,
            setup_s=self.setup_s,
            train_s=train_s,
            save_s=saved.save_s,
            peak_saved_bytes=self.trainer.peak_saved_bytes,
            planner_misses=steps.planner_misses,
            planner=PlannerSummary(**self.trainer.planner.summary()),
            world_size=self.topology.world_size,
            logical_dp=self.topology.logical_dp,
            reduction=self.config.train.reduction,
            threads_per_process=self.num_threads,
            state_dir=str(saved.state_dir),
            state_bytes=saved.state_bytes,
        )
        result.write(segment_result_path(self.run_dir, self.segment_index))
        log(
            f"segment {self.segment_index} done: loss {steps.losses[0]:.4f} -> {steps.losses[-1]:.4f}, "
            f"{result.tokens_per_s:.0f} tokens/s, state {saved.state_bytes} bytes"
        )


def _resume(trainer: Trainer, state_dir: Path, segment: SegmentPlan) -> None:
    meta = StateMeta.model_validate(load_training_state(state_dir, trainer.checkpoints))
    if meta.next_step != segment.start_step:
        raise RuntimeError(
            f"state of segment {segment.index - 1} ends at step {meta.next_step}, but segment "
            f"{segment.index} starts at {segment.start_step}; the run directory mixes plans — start a new run"
        )
