"""Logical data-parallel ranks: the same result at any number of processes, two facades, coordinated failure.

    from trainer_core.ranks import LogicalDataParallel, run_rank_zero

- `topology`: L logical ranks over W processes, the split of a batch, seeds;
  `check_topology` refuses a bad one before any process group exists.
- `reduction`: folds over logical ranks in logical order (`sharded_ordered_fold`
  for gradients, `reduce_over_logical_ranks` for losses and counts).
- `logical_gradients`: each logical rank's gradient kept apart and folded at
  the step (`deterministic`), or summed by an all-reduce (`fast`); a sharded
  model's deterministic reduction is its parallelism's
  (`trainer_core/parallel/fsdp/gradients.py`; logical ranks round-robin).
- `threads`: intra-op threads pinned per process, never derived from W.
- `rng`: each logical rank's work under its own seed, the caller's RNG streams
  restored after it.
- `coordination`: the status exchange that fails every rank when one fails.
- `logical_dp`: the SPMD facade; `rank_zero` (+ `commands`, `channel`): one
  driver on rank 0.

The names load on first use (PEP 562): the config checks its topology with
`topology`, and loading a config must not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy_exports import lazy_exports

_NAMES_BY_MODULE = {
    "coordination": ("RankFailure", "coordinated", "exchange"),
    "logical_dp": ("LogicalDataParallel", "LogicalShard"),
    "logical_gradients": ("REDUCTION_MODES", "LogicalGradients", "ReductionMode"),
    "rank_zero": ("RankZeroTrainer", "run_rank_zero"),
    "reduction": ("ordered_fold", "reduce_over_logical_ranks", "sharded_ordered_fold"),
    "commands": ("RankContext",),
    "threads": ("pin_threads", "threads_for"),
    "topology": ("Topology", "check_topology", "logical_row_ranges", "step_seed"),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _NAMES_BY_MODULE, globals())

if TYPE_CHECKING:
    from .commands import RankContext
    from .coordination import RankFailure, coordinated, exchange
    from .logical_dp import LogicalDataParallel, LogicalShard
    from .logical_gradients import REDUCTION_MODES, LogicalGradients, ReductionMode
    from .rank_zero import RankZeroTrainer, run_rank_zero
    from .reduction import ordered_fold, reduce_over_logical_ranks, sharded_ordered_fold
    from .threads import pin_threads, threads_for
    from .topology import Topology, check_topology, logical_row_ranges, step_seed
