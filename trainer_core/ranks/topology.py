"""The rank topology: L logical data-parallel ranks run by W processes, and how a batch splits over them.

A run declares `logical_dp` (L) logical ranks; each of the W physical ranks
runs L/W of them, contiguous and in logical order (rank p owns logical ranks
p·L/W … (p+1)·L/W − 1). A sharded model assigns them round-robin instead
(`assignment="round_robin"`: rank p runs ℓ = j·W + p at its j-th turn), so
that every process's j-th logical rank runs in lockstep with its peers'
(forward and backward are collectives under FSDP). Everything that decides a result — which rows a
logical rank gets, its RNG seed, the order its gradient is folded in — is a
function of the logical rank alone, never of W or of the process that runs it.

`topology_problem` is the divisibility rule, the one copy of it: W divides L,
and L divides the global batch. The config (`train.*`, trainer_core/config.py),
the node checks (trainer_core/node_topology.py) and `check_topology` (before
any process group exists, so a bad one fails in milliseconds instead of after
rendezvous) each word its refusal for their reader, from what it returns.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

Assignment = Literal["contiguous", "round_robin"]
ASSIGNMENTS = ("contiguous", "round_robin")


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    logical_dp: int
    assignment: Assignment = "contiguous"
    """How logical ranks map to processes: contiguous blocks (unsharded), or round-robin (a sharded model)."""

    def __post_init__(self) -> None:
        check_topology(self.world_size, self.logical_dp)
        if self.assignment not in ASSIGNMENTS:
            raise ValueError(f"assignment={self.assignment!r}; choose one of {ASSIGNMENTS}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank {self.rank} is outside world_size={self.world_size}; torchrun sets RANK below WORLD_SIZE"
            )

    @property
    def logical_per_rank(self) -> int:
        return self.logical_dp // self.world_size

    @property
    def local_logical_ranks(self) -> range:
        """The logical ranks this physical rank runs, in logical order (its turn order, round-robin)."""
        if self.assignment == "round_robin":
            return range(self.rank, self.logical_dp, self.world_size)
        start = self.rank * self.logical_per_rank
        return range(start, start + self.logical_per_rank)

    def owner_of(self, logical_rank: int) -> int:
        """The physical rank that runs `logical_rank`."""
        if self.assignment == "round_robin":
            return logical_rank % self.world_size
        return logical_rank // self.logical_per_rank

    def logical_row_ranges(self, num_rows: int) -> list[range]:
        """Rows of a global batch of `num_rows` per logical rank (see `logical_row_ranges`)."""
        return logical_row_ranges(num_rows, self.logical_dp)


def logical_row_ranges(num_rows: int, logical_dp: int) -> list[range]:
    """Contiguous rows per logical rank, in order: the first `num_rows % L` get one row more.

    With L dividing the batch every logical rank gets `num_rows / L` rows; with
    fewer rows than logical ranks the last ones get none (they still take part
    in every collective and contribute a zero gradient).
    """
    base, extra = divmod(num_rows, logical_dp)
    ranges, start = [], 0
    for logical_rank in range(logical_dp):
        size = base + (1 if logical_rank < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


@dataclass(frozen=True)
class Indivisible:
    """What the divisibility rule refused: `value` (the `what`) is not a multiple of `divisor`."""

    what: Literal["logical_dp", "global_batch_size"]
    value: int
    divisor: int

    @property
    def suggestion(self) -> int:
        """The multiple of `divisor` nearest below `value` (at least `divisor`): the value to suggest instead."""
        return self.divisor * max(1, self.value // self.divisor)


def topology_problem(world_size: int, logical_dp: int, global_batch_size: int | None = None) -> Indivisible | None:
    """The divisibility rule: W must divide L, then L the global batch (when given); None where both hold."""
    if logical_dp % world_size:
        return Indivisible("logical_dp", logical_dp, world_size)
    if global_batch_size is not None and global_batch_size % logical_dp:
        return Indivisible("global_batch_size", global_batch_size, logical_dp)
    return None


def check_topology(world_size: int, logical_dp: int, global_batch_size: int | None = None) -> None:
    """Raise ValueError naming the fix unless W divides L (and L divides the global batch, when given)."""
    if world_size < 1 or logical_dp < 1:
        raise ValueError(f"world_size={world_size} and logical_dp={logical_dp} must both be at least 1")
    problem = topology_problem(world_size, logical_dp, global_batch_size)
    if problem is None:
        return
    if problem.what == "logical_dp":
        divisors = [d for d in range(1, logical_dp + 1) if logical_dp % d == 0]
        raise ValueError(
            f"logical_dp={logical_dp} is not a multiple of world_size={world_size}; launch a number of processes "
            f"that divides train.logical_dp (one of {divisors}) or choose a logical_dp that {world_size} divides "
            f"(e.g. {problem.suggestion})"
        )
    raise ValueError(
        f"global_batch_size={global_batch_size} is not a multiple of logical_dp={logical_dp}; every logical rank "
        f"needs the same number of sequences (e.g. global_batch_size={problem.suggestion})"
    )


def step_seed(seed: int, step: int, logical_rank: int) -> int:
    """A seed per (run, step, logical rank): dropout does not depend on the world size."""
    digest = hashlib.sha256(f"{seed}:{step}:{logical_rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
