"""The segment's logical-DP facade for its sharding and reduction (`train.sharding`, `train.reduction`).

`segment_facade` picks it:

- `sharding = "none"`: `LogicalDataParallel` with the configured reduction.
- `sharding = "fsdp"` or `"hsdp"` (a parallelism that shards), `deterministic`: `LogicalDataParallel` too, which on
  a sharded trainer installs `ShardedLogicalGradients` (the ordered fold of
  every logical rank's gradient shards, trainer_core/parallel/fsdp/gradients.py):
  losses, weights and moments are bitwise the same at any W, and resuming at
  another W continues the same run. Its logical ranks run round-robin
  (`assignment_for`: process p runs ℓ = j·W + p), so the segment's topology is
  made round-robin from the start (`init_distributed(assignment=...)`); the
  rows, seed and fold position of a logical rank depend on ℓ alone, so every
  logical rank still trains its own rows whichever process runs it. The
  segment runner satisfies the fold's limits: one backward per logical rank's
  block (`run/steps.py`), every checkpoint stepped together, and blocks never
  empty (the config holds `global_batch_size` to a multiple of `logical_dp`),
  so the dummy turn of an empty block — run in `empty_mode`, the segment's
  forward mode — does not occur in the pipeline.
- a sharded model, `fast`: `ShardedLogicalDataParallel` below, which
  keeps the trainer's FSDP reduction.

`ShardedLogicalDataParallel`: `LogicalDataParallel` installs its
`LogicalGradients` as the trainer's gradient reduction. A sharded trainer's
gradients are summed by FSDP's own reduce-scatter (`ShardedSum`) under
`fast`, and the Trainer refuses any reduction not made for shards, so here
the facade keeps the trainer's: the logical ranks' scopes only mark which
logical rank runs (gradients accumulate straight into the shards' `.grad`),
while the facade still gives every logical rank its rows, its (seed, step,
logical rank) RNG and its coordinated command, as the unsharded segment
runner has them.
"""

from __future__ import annotations

from trainer_core.parallel import PARALLELISMS
from trainer_core.ranks import LogicalDataParallel
from trainer_core.ranks.logical_dp import backward_is_collective
from trainer_core.ranks.logical_gradients import LogicalGradients, ReductionMode
from trainer_core.ranks.topology import Assignment, Topology
from trainer_core.training import Trainer
from trainer_core.training.memory import BackwardMode


def assignment_for(sharding: str, reduction: str) -> Assignment:
    """How the segment maps logical ranks to processes: round-robin for deterministic logical ranks on a
    parallelism whose backward is a collective (every process's j-th logical rank in lockstep)."""
    lockstep = PARALLELISMS[sharding].reduces_in_backward
    return "round_robin" if lockstep and reduction == "deterministic" else "contiguous"


def segment_facade(
    trainer: Trainer, topology: Topology, *, reduction: ReductionMode, seed: int, mode: BackwardMode | None
) -> LogicalDataParallel:
    """The facade for the trainer's sharding and `reduction` (module docstring); `mode`: the forwards' mode
    (None where the planner chooses), which an empty block's dummy turn would use on a sharded model."""
    if not backward_is_collective(trainer):
        return LogicalDataParallel(trainer, topology, reduction=reduction, seed=seed)
    if reduction == "fast":
        return ShardedLogicalDataParallel(trainer, topology, seed=seed)
    if topology.assignment != "round_robin":
        raise ValueError(
            "deterministic logical ranks on a sharded model run round-robin; build the topology with "
            "init_distributed(..., assignment=assignment_for(sharding, reduction))"
        )
    return LogicalDataParallel(trainer, topology, reduction=reduction, seed=seed, empty_mode=mode or "retain")


class ShardedLogicalDataParallel(LogicalDataParallel):
    """`LogicalDataParallel` with the `fast` reduction that leaves the sharded trainer's FSDP reduction in place."""

    def __init__(self, trainer: Trainer, topology: Topology, *, seed: int = 0):
        if not backward_is_collective(trainer):
            raise ValueError("ShardedLogicalDataParallel runs a sharded trainer; use LogicalDataParallel otherwise")
        # Not LogicalDataParallel.__init__: it would replace the trainer's ShardedSum, which the Trainer refuses.
        self.trainer = trainer
        self.topology = topology
        self.seed = seed
        self.gradients = LogicalGradients(trainer, topology, "fast")
