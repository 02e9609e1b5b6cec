"""The logical-DP facade over a sharded trainer with `train.reduction = "fast"` (`train.sharding = "fsdp"`).

`LogicalDataParallel` installs its `LogicalGradients` as the trainer's
gradient reduction. A sharded trainer's gradients are summed by FSDP's own
reduce-scatter (`ShardedSum`), and the Trainer refuses any other reduction,
so here the facade keeps the trainer's: under `fast` the logical ranks'
scopes only mark which logical rank runs (gradients accumulate straight into
the shards' `.grad`), while the facade still gives every logical rank its
rows, its (seed, step, logical rank) RNG and its coordinated command, as the
unsharded segment runner has them. Deterministic logical ranks on shards are
refused by the config until they exist (trainer_core/config.py).
"""

from __future__ import annotations

from trainer_core.ranks import LogicalDataParallel
from trainer_core.ranks.logical_gradients import LogicalGradients
from trainer_core.ranks.topology import Topology
from trainer_core.training import Trainer


class ShardedLogicalDataParallel(LogicalDataParallel):
    """`LogicalDataParallel` with the `fast` reduction that leaves the sharded trainer's FSDP reduction in place."""

    def __init__(self, trainer: Trainer, topology: Topology, *, seed: int = 0):
        if trainer.sharding is None:
            raise ValueError("ShardedLogicalDataParallel runs a sharded trainer; use LogicalDataParallel otherwise")
        # Not LogicalDataParallel.__init__: it would replace the trainer's ShardedSum, which the Trainer refuses.
        self.trainer = trainer
        self.topology = topology
        self.seed = seed
        self.gradients = LogicalGradients(trainer, topology, "fast")
