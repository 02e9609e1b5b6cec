"""What each parallelism cannot do yet, as a torch-free table the config checks before anything launches.

A limit found only inside the ranks costs a rendezvous, a model build on
every process and a failed segment; the same limit checked here is exit 2
with the fix named, before anything is written. Each parallelism's own file
raises the same refusal too (a caller may build one without a config).
"""

from __future__ import annotations

from typing import NamedTuple

from .names import PARALLELISM_NAMES


class ParallelismLimits(NamedTuple):
    """One parallelism's limits (the defaults: none)."""

    loads_model_path: bool = True
    """Whether `model.path` (weights loaded by rows straight into the processes' parts) is supported."""
    deterministic_min_processes_per_node: int = 1
    """The fewest processes per node its deterministic reduction folds over when there are several nodes."""


PARALLELISM_LIMITS: dict[str, ParallelismLimits] = {
    "none": ParallelismLimits(),
    "fsdp": ParallelismLimits(),
    # hsdp.py: the row-wise loader shards over a 1-D mesh; fsdp/fold.py: a replica of one process reduces nothing.
    "hsdp": ParallelismLimits(loads_model_path=False, deterministic_min_processes_per_node=2),
}
if tuple(PARALLELISM_LIMITS) != PARALLELISM_NAMES:
    raise ImportError(f"PARALLELISM_LIMITS names {tuple(PARALLELISM_LIMITS)}, the registry {PARALLELISM_NAMES}")
