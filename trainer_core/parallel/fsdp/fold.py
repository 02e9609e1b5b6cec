"""The deterministic reduction over logical ranks for an FSDP2-sharded model: a fold whose bits do not depend on W.

FSDP's own reduce-scatter adds the W processes' gradients in whatever order
its algorithm and W give, so a sum over L logical ranks run by W processes
changes in the last bits with W. Here the logical ranks are assigned to
processes round-robin (process p runs ℓ = j·W + p at its j-th turn, all
processes in lockstep, because forward and backward gather collectively), and
each FSDP unit's reduce-scatter is replaced by `OrderedScatterFold`: in turn
for each source process p = 0 … W−1, p scatters its unsharded gradient's
chunks to their owners, and every owner adds the chunk it received to its
accumulator. Turn j therefore adds logical ranks j·W, j·W + 1, … in increasing
order onto the committed accumulator: at the owner of every element the sum
is `(((g0 + g1) + g2) + …) + g(L−1)`, the unsharded trainer's fold
(`ranks/reduction.py:ordered_fold`), at any W. At W = 1 FSDP never calls a
custom reduce-scatter; `OrderedFolds.commit` folds per parameter instead
(element-wise addition: the same bits).

A turn is a transaction (`OrderedFolds.begin` / `commit` / `abort`): the
committed gradient shards are stashed and FSDP writes the turn's fold into
fresh `.grad` shards, which become the gradient only at `commit`, after every
process agreed. `abort` puts the stashed shards back: bitwise unchanged on
every process. A process with no data at a turn (an empty logical rank) runs
a dummy forward/backward of the same outputs (every unit must reduce in
lockstep) with `begin(empty=True)`: its chunks are sent as +0.

Memory: one scatter turn receives 1/W of the unit's gradient, so the fold
holds FSDP's own reduce-scatter buffers (one unsharded unit's gradient and
its shard) plus one shard; never the L/W full gradients per process the
unsharded reduction keeps (`ranks/logical_gradients.py`). The price is W
sequential scatters per unit instead of one reduce-scatter.

HSDP (a 2-D mesh: R replicas × S shards, process p = r·S + s): FSDP
reduce-scatters over the shard dimension, then all-reduces over the replicas.
The ordered fold must still add all W = R·S processes' chunks in process
order, which no sum of per-replica partials gives (float addition does not
associate). So replica 0's owners fold every process's chunk, in process
order, each sent to them point to point (one chunk at a time: still one
shard beyond FSDP's buffers); the other replicas write -0.0, the exact
identity of addition (x + -0.0 is x, -0.0 included), so FSDP's all-reduce
hands every replica replica 0's fold bit for bit. One process per node
(S = 1) is refused: FSDP then calls no reduce-scatter at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
from torch.distributed.tensor import DTensor

from .shard import ShardedModel, recover_after_failed_pass

__all__ = ["OrderedFolds", "OrderedScatterFold", "round_robin_logical_ranks"]


def round_robin_logical_ranks(rank: int, world_size: int, logical_dp: int) -> list[int]:
    """The logical ranks process `rank` runs under sharding, in turn order: ℓ = j·W + rank."""
    if logical_dp % world_size:
        raise ValueError(
            f"logical_dp={logical_dp} is not a multiple of the {world_size} processes; "
            "set train.logical_dp to a multiple of nnodes × nproc_per_node"
        )
    return list(range(rank, logical_dp, world_size))


class OrderedScatterFold(ReduceScatter):
    """One FSDP unit's reduce-scatter as an ordered fold (module docstring); installed by `OrderedFolds`."""

    def __init__(self, folds: OrderedFolds) -> None:
        self._folds = folds
        self.committed: torch.Tensor | None = None
        """The unit's committed flat gradient shard (the buffer the committed `.grad` shards view), None before any."""
        self.staged: torch.Tensor | None = None
        """This turn's fold, viewed by the fresh `.grad` shards; the accumulator once committed."""
        self.peak_own_bytes = 0
        """The most bytes the fold allocated beyond FSDP's own reduce-scatter buffers (its receive buffer)."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> None:
        # `op` is ignored: the fold always sums (shard_model forces SUM with divide factor 1, so nothing else
        # scales the input). The fold is synchronous, so there is no work handle to return.
        if not self._folds.in_turn:
            raise RuntimeError("an FSDP backward ran outside OrderedFolds.begin()/commit(): its fold has no turn")
        if self.staged is not None:
            # A second reduction of this unit in one turn (two graphs in one backward) would start again from the
            # committed shard and lose the first one's fold.
            raise RuntimeError(
                "one turn reduced an FSDP unit twice (several graphs in one backward); backward each once"
            )
        world_size, rank = group.size(), group.rank()
        chunks = input_tensor.view(world_size, -1)
        if self._folds.empty:
            chunks.zero_()  # +0, not 0·g: a dummy loss times zero can still carry NaN or -0.0
        received = torch.empty_like(output_tensor)
        self.peak_own_bytes = max(self.peak_own_bytes, received.numel() * received.element_size())
        if self._folds.process_grid is not None:
            self._fold_over_replicas(output_tensor, chunks, received, self._folds.process_grid)
        else:
            for source in range(world_size):
                # Every owner receives `source`'s chunk of the elements it owns, then adds it: sources in order.
                scatter_list = list(chunks.unbind(0)) if source == rank else None
                dist.scatter(received, scatter_list, group=group, group_src=source)
                self._add(output_tensor, received, first=source == 0)
        self.staged = output_tensor

    def _add(self, output_tensor: torch.Tensor, received: torch.Tensor, *, first: bool) -> None:
        """Add one source's chunk onto the fold: the first source's onto the committed shard (or in its place)."""
        if first and self.committed is None:
            output_tensor.copy_(received)
        else:
            if first:
                output_tensor.copy_(self.committed)  # type: ignore[arg-type]  # not None here
            output_tensor.add_(received)

    def _fold_over_replicas(
        self, output_tensor: torch.Tensor, chunks: torch.Tensor, received: torch.Tensor, grid: list[list[int]]
    ) -> None:
        """HSDP (module docstring): every process's chunk, in process order, to its owner in replica 0.

        `grid[r][s]` is the global rank of replica r's shard s. Point to point, every process walking the sources
        in the same order: a source's sends are matched by owners that reached the same source, so none waits on
        a later one.
        """
        me = dist.get_rank()
        owners = grid[0]
        for index, source in enumerate(rank for replica in grid for rank in replica):
            if source == me:
                for shard, owner in enumerate(owners):
                    if owner == me:
                        self._add(output_tensor, chunks[shard], first=index == 0)
                    else:
                        dist.send(chunks[shard].contiguous(), dst=owner)
            elif me in owners:
                dist.recv(received, src=source)
                self._add(output_tensor, received, first=index == 0)
        if me not in owners:
            # -0.0 is the identity of addition for every value: FSDP's all-reduce over the replicas gives each one
            # replica 0's fold bit for bit.
            output_tensor.fill_(-0.0)


class OrderedFolds:
    """Every unit's `OrderedScatterFold` of one sharded model, and the turn transaction around a backward.

    Per turn: `begin(empty=...)`, the forward and backward (FSDP reduces each unit as its backward ends),
    then `commit()` once every process agreed the turn succeeded, or `abort()`. `reset()` after the optimizer
    step cleared the gradients. Collective: every process runs the same turns in the same order.
    """

    def __init__(self, sharded: ShardedModel) -> None:
        self._units: list[tuple[OrderedScatterFold, list[FSDPParam]]] = []
        seen: set[int] = set()
        for unit in sharded.units:
            state = fully_shard.state(unit)  # type: ignore[arg-type]  # an FSDPModule is an nn.Module
            if id(state) in seen:
                continue
            seen.add(id(state))
            params = [fp for group in state._fsdp_param_groups for fp in group.fsdp_params]
            fold = OrderedScatterFold(self)
            unit.set_custom_reduce_scatter(fold)
            # Every parameter that requires grad is reduced (a zero where the turn's graph did not reach it), so a
            # unit's flat layout, and with it the committed accumulator's, is the same at every turn.
            unit.set_reduce_scatter_unused_params(True, recurse=False)
            self._units.append((fold, params))
        self._sharded = sharded
        self._has_committed = False  # at W = 1 the folds hold no buffer: whether `.grad` is a sum to add onto
        self.in_turn = False
        self.empty = False
        self._stash: dict[FSDPParam, torch.Tensor | None] = {}
        first = next((params[0] for _, params in self._units if params), None)
        mesh = first.sharded_param.device_mesh if first is not None else None  # type: ignore[attr-defined]
        self._world_size = mesh.size() if mesh is not None else 1
        self.process_grid: list[list[int]] | None = None
        """HSDP: the global rank of each (replica, shard), when a 2-D mesh has several replicas; else None."""
        if mesh is not None and mesh.ndim == 2 and mesh.size(0) > 1:
            if mesh.size(1) == 1:
                raise ValueError(
                    f"the deterministic fold over HSDP needs at least 2 processes per replica, got a mesh of "
                    f"{tuple(mesh.shape)} (FSDP reduces nothing within a replica of one); use train.sharding = "
                    "'fsdp' at one process per node, or train.reduction = 'fast'"
                )
            self.process_grid = mesh.mesh.tolist()

    @property
    def peak_own_bytes(self) -> int:
        """The most bytes one unit's fold allocated beyond FSDP's own buffers (`OrderedScatterFold.peak_own_bytes`)."""
        return max((fold.peak_own_bytes for fold, _ in self._units), default=0)

    def begin(self, *, empty: bool = False) -> None:
        """Start a turn: stash every committed gradient shard so FSDP writes this turn's fold into fresh ones."""
        if self.in_turn:
            raise RuntimeError("OrderedFolds.begin() inside a turn: commit() or abort() the open one first")
        self._stash = {}
        for fold, params in self._units:
            fold.staged = None
            for fp in params:
                self._stash[fp] = fp.sharded_param.grad
                fp.sharded_param.grad = None
        self.in_turn, self.empty = True, empty

    def commit(self) -> None:
        """The turn's fold becomes the gradient (call it only once every process agreed the turn succeeded)."""
        self._require_turn("commit")
        for fold, params in self._units:
            if self._world_size == 1:
                self._fold_in_place(params)
            elif fold.staged is None:
                self._restore(params)  # this unit's parameters were not in the turn's graph: nothing to add
            else:
                fold.committed, fold.staged = fold.staged, None
        self._has_committed = True
        self._end()

    def abort(self) -> None:
        """Drop the turn's fold: every committed gradient shard is back, bitwise as it was.

        Also after an exception inside the forward or the backward: FSDP is put back in a clean state first
        (`sharding.recover_after_failed_pass`), so the retried turn starts from resharded units.
        """
        self._require_turn("abort")
        recover_after_failed_pass(self._sharded)
        for fold, params in self._units:
            fold.staged = None
            self._restore(params)
        self._end()

    def reset(self) -> None:
        """Forget the committed folds (after a step used them): the next turn starts a new sum.

        The gradients stay in `.grad` until the next turn replaces them, at any W (the step may still read them).
        """
        if self.in_turn:
            raise RuntimeError("OrderedFolds.reset() inside a turn: commit() or abort() it first")
        for fold, _ in self._units:
            fold.committed = fold.staged = None
        self._has_committed = False

    def _fold_in_place(self, params: list[FSDPParam]) -> None:
        # W = 1: FSDP copied this turn's gradient into fresh shards (no custom comm); add them onto the committed.
        for fp in params:
            fresh, committed = fp.sharded_param.grad, self._stash[fp] if self._has_committed else None
            if fresh is not None and self.empty:
                _local(fresh).zero_()
            if fresh is None:
                fp.sharded_param.grad = committed
            elif committed is not None:
                _local(committed).add_(_local(fresh))
                fp.sharded_param.grad = committed

    def _restore(self, params: list[FSDPParam]) -> None:
        for fp in params:
            fp.sharded_param.grad = self._stash[fp]

    def _require_turn(self, what: str) -> None:
        if not self.in_turn:
            raise RuntimeError(f"OrderedFolds.{what}() without begin()")

    def _end(self) -> None:
        self._stash = {}
        self.in_turn = self.empty = False


def _local(gradient: torch.Tensor) -> torch.Tensor:
    """The local shard itself (not a copy: the fold writes it in place)."""
    return gradient._local_tensor if isinstance(gradient, DTensor) else gradient
