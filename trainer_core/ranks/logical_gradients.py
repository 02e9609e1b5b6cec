"""Each logical rank's gradient kept apart, and summed over logical ranks at the step in a W-independent order.

`LogicalGradients` is the trainer's `gradient_reduction` under the logical-rank
facades (see `trainer_core.training.gradient_reduction`):

- **deterministic** (`train.reduction = "deterministic"`, the default): while a
  logical rank is active (`scope`), the checkpoints' `.grad` *is* that logical
  rank's accumulator — it is swapped in on entry and out on exit — so the
  transactional backward accumulates each logical rank's micro-batches alone.
  The step folds the L partial gradients in logical order
  (`reduction.sharded_ordered_fold`), a logical rank without a gradient
  counting as zeros: the same sum, bit for bit, at any W. The step's norm
  is `canonical_norm` (float64 rows, a fixed pairwise tree), as the sharded
  deterministic reduction's, so the two agree to the bit even when clipping;
- **fast**: backwards accumulate straight into `.grad` and the step
  all-reduces each process's sum, as plain data parallelism does; the
  association then depends on W (results differ from W = 1 in the last bits),
  and the norm is torch's `get_total_norm` in float32.

In both modes a backward agrees with nobody: its outcome is exchanged when the
logical rank's command ends (`coordination`), and a backward outside any
logical rank is refused, since its gradient would belong to no logical rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from ..parallel.tensors import is_distributed
from ..training.checkpoints import Checkpoint
from ..training.gradient_reduction import RankSum
from .flat_partials import assign_folded, pack_partials
from .fold_buckets import FoldRound, _Member
from .reduction import sharded_ordered_fold
from .topology import Topology

ReductionMode = Literal["deterministic", "fast"]
REDUCTION_MODES = ("deterministic", "fast")
_Key = tuple[str, str]  # (checkpoint, parameter)


class LogicalGradients:
    backward_is_collective = False

    def __init__(
        self, trainer, topology: Topology, mode: ReductionMode = "deterministic", *, replicated_only: bool = False
    ):
        """`replicated_only`: keep apart only parameters that are not sharded (distributed ones are the sharded fold's,
        `parallel.fsdp.gradients.ShardedLogicalGradients`, which uses this for a sharded model's heads)."""
        if mode not in REDUCTION_MODES:
            raise ValueError(
                f"reduction={mode!r}; choose 'deterministic' (bitwise the same at any world size) or 'fast'"
            )
        self._trainer = trainer
        self.topology = topology
        self.mode = mode
        self._replicated_only = replicated_only
        self._partials: dict[int, dict[_Key, torch.Tensor]] = {rank: {} for rank in topology.local_logical_ranks}
        self.active: int | None = None
        """The logical rank whose backwards run now, or None."""
        self._round: FoldRound | None = None
        self._round_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None
        self.overlap_counts = {"rounds_folded": 0, "rounds_dropped": 0, "buckets_sent_in_backward": 0}
        """What the overlapped fold did (`overlapped_step`): rounds the step used or dropped, buckets sent early."""

    @property
    def deterministic(self) -> bool:
        return self.mode == "deterministic"

    @property
    def canonical_norm(self) -> bool:
        """Read by the step (`gradient_reduction`): deterministic steps clip with `ranks.canonical_norm`."""
        return self.deterministic

    def _parameters(self) -> Iterator[tuple[_Key, torch.nn.Parameter]]:
        for checkpoint_name, checkpoint in self._trainer.checkpoints.items():
            for param_name, param in checkpoint.parameters().items():
                if not (self._replicated_only and is_distributed(param)):
                    yield (checkpoint_name, param_name), param

    @contextlib.contextmanager
    def scope(self, logical_rank: int) -> Iterator[None]:
        """Run backwards as `logical_rank`: their gradients accumulate in its own accumulator."""
        if logical_rank not in self._partials:
            raise ValueError(
                f"logical rank {logical_rank} is not run by this process (it runs "
                f"{list(self.topology.local_logical_ranks)})"
            )
        if self.active is not None:
            raise RuntimeError(
                f"logical rank {logical_rank} entered while logical rank {self.active} is active; "
                "finish one logical rank's work before starting the next"
            )
        self.active = logical_rank
        if not self.deterministic:
            try:
                yield
            finally:
                self.active = None
            return
        partial = self._partials[logical_rank]
        outside: dict[_Key, torch.Tensor | None] = {}
        for key, param in self._parameters():
            outside[key], param.grad = param.grad, partial.pop(key, None)
        try:
            yield
        finally:
            for key, param in self._parameters():
                if param.grad is not None:
                    partial[key] = param.grad
                param.grad = outside.get(key)
            self.active = None

    # -- the fold overlapped with the last backward (`fold_buckets.py`) -------------

    @contextlib.contextmanager
    def overlapped_step(self) -> Iterator[None]:
        """One step's logical ranks' work (every process alike): the backward `final_backward` marks sends its
        gradients while it runs, the rest leave at the block's end, and the step folds what they carried."""
        members = self._round_members() if self.deterministic and self.topology.world_size > 1 else []
        if self._replicated_only or not members:  # a sharded model's heads: its fold runs in backward
            yield
            return
        self._drop_round()  # a round no step used: its messages still finish on every process alike
        groups = self._round_groups
        if groups is None:  # every process opens its first round at the same point: a collective
            device = members[0].optimized.device
            groups = self._round_groups = (_new_group(self.topology, device), _new_group(self.topology, device))
        fold_round = FoldRound(members, self.topology, groups, lambda: self._partials)
        self._round = fold_round
        ok = False
        try:
            yield
            ok = True
        finally:
            fold_round.close(ok)

    def final_backward(self) -> contextlib.AbstractContextManager:
        """Mark the backward this process runs last before the step (its last logical rank's last micro-batch)."""
        fold_round = self._round
        if fold_round is None or fold_round.closed or self.active is None:
            return contextlib.nullcontext()
        return fold_round.watch(self.active)

    def begin_backward(self) -> None:
        if self._round is not None:
            self._round.backward_began()

    def _round_members(self) -> list[_Member]:
        """Every parameter a round folds, with the tensor its sum goes to (the FP32 master where there is one)."""
        optimized = {name: checkpoint.optimized_parameters() for name, checkpoint in self._trainer.checkpoints.items()}
        return [
            _Member(key, param, optimized[key[0]][key[1]])
            for key, param in self._parameters()
            if not is_distributed(param)
        ]

    def _drop_round(self) -> None:
        fold_round, self._round = self._round, None
        if fold_round is not None:
            fold_round.close(False)
            fold_round.drop()
            self.overlap_counts["rounds_dropped"] += 1

    # -- the trainer's GradientReduction -------------------------------------------

    def agree_on_backward(self, error: BaseException | None) -> BaseException | None:
        if error is None and self.active is None:
            return ValueError(
                "backward ran outside any logical rank, so its gradient belongs to none; run it inside "
                "`with shard:` (logical-DP facade) or through the rank-zero facade — nothing was accumulated"
            )
        return error

    def check_ready(self) -> None:
        """Refuse a step inside a logical rank, or with gradients that belong to no logical rank."""
        if self.active is not None:
            raise RuntimeError(f"step() called inside logical rank {self.active}; step after every logical rank's work")
        if self.deterministic:
            stray = [f"{c}.{p}" for (c, p), param in self._parameters() if param.grad is not None]
            if stray:
                raise RuntimeError(
                    f"gradients outside any logical rank on {stray[:3]}; accumulate them through "
                    "trainer.backward inside a logical rank"
                )

    def local_flags(self, checkpoints: Sequence[Checkpoint]) -> list[list[bool]]:
        self.check_ready()
        if not self.deterministic:
            return [checkpoint.has_gradient() for checkpoint in checkpoints]
        return [
            [
                any((checkpoint.name, name) in partial for partial in self._partials.values())
                for name in checkpoint.parameters()
            ]
            for checkpoint in checkpoints
        ]

    def reduce(self, checkpoints: Sequence[Checkpoint], anywhere: Sequence[Sequence[bool]]) -> None:
        if not self.deterministic:
            RankSum().reduce(checkpoints, anywhere)
            return
        targets = [
            ((checkpoint.name, name), tensor)
            for checkpoint, flags in zip(checkpoints, anywhere, strict=True)
            for (name, tensor), flag in zip(checkpoint.optimized_parameters().items(), flags, strict=True)
            if flag
        ]
        fold_round, self._round = self._round, None
        if fold_round is not None:
            # Closed already, unless a step runs inside the step's block (unvouched then, on every process alike).
            fold_round.close(False)
            wanted = {key for key, _ in targets}
            if not fold_round.covers(wanted):  # a checkpoint added since the round opened
                fold_round.vouched = False
            if fold_round.vote():
                self.overlap_counts["rounds_folded"] += 1
                self.overlap_counts["buckets_sent_in_backward"] += fold_round.sent_in_backward
                fold_round.fold_into(wanted.__contains__)
                for key, _ in targets:
                    for partial in self._partials.values():
                        partial.pop(key, None)
            else:
                self.overlap_counts["rounds_dropped"] += 1
                fold_round.drop()
                fold_round = None
        if fold_round is None:
            by_dtype: dict[torch.dtype, list[tuple[_Key, torch.Tensor]]] = {}
            for key, tensor in targets:
                by_dtype.setdefault(tensor.dtype, []).append((key, tensor))
            for dtype, group in by_dtype.items():
                self._fold_group(dtype, group)
        for checkpoint in checkpoints:  # every gradient of these checkpoints now lives on the optimized tensors
            for name, param in checkpoint.parameters().items():
                if param is not checkpoint.optimized_parameters()[name]:
                    param.grad = None
            for partial in self._partials.values():
                for name in checkpoint.parameters():
                    partial.pop((checkpoint.name, name), None)

    def _fold_group(self, dtype: torch.dtype, group: list[tuple[_Key, torch.Tensor]]) -> None:
        """Fold one dtype's gradients over logical ranks and set them as the optimized tensors' `.grad`."""
        rows = [self._partials[logical_rank] for logical_rank in self.topology.local_logical_ranks]
        members = [(key, tensor.numel()) for key, tensor in group]
        local = pack_partials(members, rows, self.topology.world_size, dtype, group[0][1].device)
        for partial in rows:
            for key, _ in group:
                partial.pop(key, None)
        folded = sharded_ordered_fold(local, self.topology)
        assign_folded([(tensor, True) for _, tensor in group], folded)

    def clear(self) -> None:
        for partial in self._partials.values():
            partial.clear()
        if self._round is not None:
            self._round.vouched = False  # what it sent is gone


def _new_group(topology: Topology, device: torch.device) -> dist.ProcessGroup:
    group = dist.new_group(ranks=list(range(topology.world_size)), timeout=_collective_timeout(device))
    assert isinstance(group, dist.ProcessGroup), "every process is a member of the round's group"
    # Set up now, every process at once: a backend that connects at its first collective (NCCL) must not do it
    # from a gradient hook, while a peer whose last logical rank is empty waits in another group's collective.
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    return group


def _collective_timeout(device: torch.device) -> timedelta | None:
    """The default group's timeout (`train.collective_timeout_s`), which a new group does not inherit: its own
    default is 30 minutes, and a message pending to a dead peer would hold this process that long."""
    try:
        timeout = dist.group.WORLD._get_backend(device).options._timeout  # pyright: ignore[reportAttributeAccessIssue, reportOptionalMemberAccess]
    except (AttributeError, RuntimeError):  # another torch's internals: the backend's default, as before
        return None
    return timeout if isinstance(timeout, timedelta) else None
