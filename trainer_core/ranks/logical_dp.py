"""The logical-DP facade: SPMD code sees the logical ranks its process runs and each one's shard of the batch.

    ldp = LogicalDataParallel(trainer, topology, seed=run_seed)      # installs the logical reduction
    for step in range(num_steps):
        loss_sums = {}
        for shard in ldp.forward_batches(global_batch, step=step):   # this process's logical ranks, in order
            with shard:                                              # one command: seeded, own gradient, exchanged
                out = trainer.forward(shard.rows["input_ids"], shard.rows["attention_mask"])
                loss_sum = my_loss_sum(out.logprobs, shard.rows)
                trainer.backward(loss_sum / num_loss_tokens_in_global_batch)
                loss_sums[shard.logical_rank] = loss_sum.detach()
        loss = ldp.reduce(loss_sums, "sum") / num_loss_tokens_in_global_batch
        ldp.step(learning_rate=…)

Every process holds the global batch; `forward_batches` gives logical rank r
the rows `logical_row_ranges(B, L)[r]`. A logical rank whose share is empty
still takes part in every collective: with `yield_empty=True` (default) the
caller sees it (`shard.empty`) and may skip its work inside `with shard:`;
with False the facade runs its (empty) command itself. Either way its gradient
is zeros and the step matches W = 1 bitwise.

Inside `with shard:` torch's global RNG (CPU and the model's device) is
seeded with (seed, step, logical rank); at the block's end the caller's
streams are back as they were (`rng`), so draws outside the blocks — a
shuffle of the next batch — are the same on every process and at every W.

On a sharded trainer (`Trainer(model, parallelism=...)` that reduces in backward) with the deterministic
reduction, the logical ranks run round-robin (`self.topology.assignment`:
process p runs ℓ = j·W + p) and every process's j-th block runs in lockstep
(`trainer_core/parallel/fsdp/gradients.py`): each block runs one forward and one backward, or
none — then the facade runs a dummy forward/backward (`empty_mode`) whose
gradient counts as zeros, so an empty shard may still be skipped.

All work of a logical rank belongs inside `with shard:`: the block is one
command of `coordination` — an exception in it, on any process, fails every
process at the block's end with the failing rank named. Work outside a block
that fails on one process only ends that process; its peers then fail when
their next collective loses it (or torchrun stops them).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from trainer_core.parallel.fsdp.gradients import ShardedLogicalGradients
from trainer_core.run.faults import maybe_inject_command_fault
from trainer_core.training.memory import BackwardMode

from .coordination import coordinated
from .logical_gradients import LogicalGradients, ReductionMode
from .reduction import ReduceOp, reduce_over_logical_ranks
from .rng import logical_rank_rng, model_device
from .topology import Topology, step_seed


def backward_is_collective(trainer) -> bool:
    """Whether the trainer's parallelism sums gradients inside backward (a collective: every process's logical
    ranks run in lockstep); False for a stand-in trainer without one."""
    parallelism = getattr(trainer, "parallelism", None)
    return bool(parallelism is not None and parallelism.reduces_in_backward)


@dataclass(eq=False)
class LogicalShard:
    """One logical rank's share of a step's global batch; enter it (`with shard:`) to run its work."""

    logical_rank: int
    rows: dict[str, torch.Tensor]
    """Every tensor of the global batch, cut to this logical rank's rows."""
    num_rows: int
    _facade: "LogicalDataParallel" = field(repr=False)
    _step: int = field(repr=False)
    _command: contextlib.AbstractContextManager | None = field(default=None, repr=False)
    entered: bool = field(default=False, repr=False)

    @property
    def empty(self) -> bool:
        return self.num_rows == 0

    def __enter__(self) -> "LogicalShard":
        if self._command is not None or self.entered:
            raise RuntimeError(f"logical rank {self.logical_rank}'s shard was already entered; enter each shard once")
        self.entered = True
        self._command = self._run()
        self._command.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        command, self._command = self._command, None
        assert command is not None, "__exit__ without __enter__"
        return bool(command.__exit__(*exc))

    @contextlib.contextmanager
    def _run(self) -> Iterator[None]:
        facade = self._facade
        # Outermost: the status exchange, which runs whatever the inner parts raise; on a sharded model the work is
        # FSDP's collectives in lockstep, and a failing rank leaves instead (`coordinated`'s `lockstep`).
        with coordinated(
            f"the logical ranks' work of step {self._step}",
            where=f"logical rank {self.logical_rank}",
            lockstep=backward_is_collective(facade.trainer),
        ):
            seed = step_seed(facade.seed, self._step, self.logical_rank)
            with facade.gradients.scope(self.logical_rank), logical_rank_rng(seed, model_device(facade.trainer.model)):
                maybe_inject_command_fault("logical_rank", facade.topology.rank)
                yield


class LogicalDataParallel:
    """SPMD over logical ranks: a trainer, the topology, and the order-preserving reduction installed on the trainer."""

    def __init__(
        self,
        trainer,
        topology: Topology,
        *,
        reduction: ReductionMode = "deterministic",
        seed: int = 0,
        empty_mode: BackwardMode = "retain",
    ):
        """On a sharded trainer (`Trainer(..., parallelism=...)`) with the deterministic reduction, the logical
        ranks run round-robin (`self.topology`; `parallel/fsdp/gradients.py`), and an empty logical rank's block runs a
        dummy forward/backward in `empty_mode` (the mode of the real blocks' forwards, retain or offload)."""
        self.trainer = trainer
        self.seed = seed
        self.gradients: LogicalGradients | ShardedLogicalGradients
        if backward_is_collective(trainer) and reduction == "deterministic":
            topology = dataclasses.replace(topology, assignment="round_robin")
            self.gradients = ShardedLogicalGradients(trainer, topology, empty_mode=empty_mode)
        else:
            self.gradients = LogicalGradients(trainer, topology, reduction)
        self.topology = topology
        trainer.gradient_reduction = self.gradients

    def forward_batches(
        self, batch: Mapping[str, torch.Tensor], *, step: int, yield_empty: bool = True
    ) -> Iterator[LogicalShard]:
        """This process's logical ranks' shards of `batch` (tensors with the batch in dimension 0), in logical order.

        `step` seeds each logical rank's RNG with (seed, step, logical rank) inside its block; the
        caller's RNG is left as it was.
        A shard the caller does not enter (an empty one with `yield_empty=False`,
        or one it skipped) is entered empty by the facade, so every process runs
        the same commands.
        """
        sizes = {name: tensor.shape[0] for name, tensor in batch.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(
                f"batch tensors disagree on the number of rows: {sizes}; every tensor needs the batch in dimension 0"
            )
        num_rows = next(iter(sizes.values()), 0)
        ranges = self.topology.logical_row_ranges(num_rows)
        for logical_rank in self.topology.local_logical_ranks:
            rows = ranges[logical_rank]
            shard = LogicalShard(
                logical_rank,
                {name: tensor[rows.start : rows.stop] for name, tensor in batch.items()},
                len(rows),
                self,
                step,
            )
            if yield_empty or not shard.empty:
                yield shard
            if not shard.entered:
                with shard:
                    pass

    def overlapped_step(self) -> contextlib.AbstractContextManager:
        """Around one step's `forward_batches` loop, on every process: the deterministic fold's messages leave while
        the backward `final_backward` marks still runs (`fold_buckets.py`); the same bits as without it."""
        overlapped = getattr(self.gradients, "overlapped_step", None)
        return overlapped() if overlapped is not None else contextlib.nullcontext()

    def final_backward(self) -> contextlib.AbstractContextManager:
        """Inside a shard: the backward run in this block is this process's last before the step."""
        final = getattr(self.gradients, "final_backward", None)
        return final() if final is not None else contextlib.nullcontext()

    def reduce(
        self, values: Mapping[int, torch.Tensor] | Sequence[torch.Tensor | None], op: ReduceOp = "sum"
    ) -> torch.Tensor:
        """Sum or mean of one value per logical rank, in logical order: bitwise the same at any world size."""
        return reduce_over_logical_ranks(values, op, self.topology)

    def step(self, names=None, *, learning_rate: float | None = None, schedule_step: int | None = None):
        """`trainer.step` as one command: checks exchanged first (no rank enters the reduction alone), then the step."""
        with coordinated("step"):
            maybe_inject_command_fault("step", self.topology.rank)
            self.gradients.check_ready()
        with coordinated("step", collectives=True):  # the reduction's collectives
            return self.trainer.step(names, learning_rate=learning_rate, schedule_step=schedule_step)

    def command(self, name: str):
        """A block of any other work (saving, a callback) as one command: a failure anywhere fails every rank."""
        return _command(name, self.topology.rank)


@contextlib.contextmanager
def _command(name: str, rank: int) -> Iterator[None]:
    with coordinated(name):
        maybe_inject_command_fault(name, rank)
        yield
