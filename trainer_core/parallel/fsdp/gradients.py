"""Deterministic logical ranks on a sharded model: the trainer's gradient reduction that drives `OrderedFolds`.

`ShardedLogicalGradients` is what `LogicalGradients` is for a replicated
model, for `Trainer(model, sharding=...)`: the sum over L logical ranks is
`(((g0 + g1) + g2) + …) + g(L−1)` element by element, bitwise the same at any
W and bitwise the unsharded trainer's, but it never holds L/W full gradients:

- logical ranks run round-robin (`Topology(assignment="round_robin")`:
  process p runs ℓ = j·W + p at its j-th turn), every process's j-th logical
  rank in lockstep with its peers', because forward and backward are
  collectives under FSDP;
- each logical rank's one backward is a turn of `OrderedFolds`: `begin`
  before autograd runs (`begin_backward`), FSDP's reduce-scatter replaced by
  the ordered fold onto the committed shards, then every process's outcome
  exchanged (`ranks_agree`) and the turn committed, or aborted on every
  process (every shard bitwise as before) — the trainer's own transaction
  publishes the fold's output as the new `.grad` (at W > 1 the fold already
  added the committed gradient, so the turn starts from `.grad = None`; at
  W = 1 FSDP calls no reduce-scatter and the transaction's `existing +
  staged` is the same fold);
- a logical rank whose block ran no backward (an empty share of the batch)
  runs a dummy forward/backward at the block's end, as an empty turn whose
  chunks are sent as +0 (`begin(empty=True)`); at W = 1 it has no peers to
  keep in step and adds +0 in place instead (the unsharded fold's zeros).
  The dummy draws nothing from the caller's RNG streams (its dropout runs on
  a fork of them): they stay exactly those of W = 1, where no dummy runs;
- at the step the sharded `.grad` already holds the global sum (`reduce` is
  a no-op for shards); parameters that are not sharded (a head registered
  with `add_module_checkpoint`, replicated) keep one partial per logical rank
  and are folded in logical order as the unsharded path does
  (`LogicalGradients(replicated_only=True)`);
- the step's norm is `canonical_norm` (its bits depend neither on W nor on
  sharding).

Limits (refused, with the fix named): one backward per logical rank's block
(a second one would fold as its own turn, another association than the
unsharded partial's); a step must select every checkpoint that holds sharded
gradients (the folds are reset after it). The dummy forward runs in
`empty_mode` ("retain" by default): the real blocks must use a mode with the
same collectives (retain or offload, not replay), or pass their mode as
`empty_mode`. At W > 1 every process's first forward of a block (the dummy's
included) exchanges its mode (`begin_forward`, one small all-gather) before
any of FSDP's collectives, so a turn whose forwards would gather differently —
a replay beside an empty logical rank, a no_grad forward beside a dummy, or the
planner choosing differently on two processes — is refused on every process
at once, naming the rule, instead of aborting in a mismatched collective. Only
a block's first forward is exchanged: a block with a second forward beside an
empty logical rank (whose dummy runs one) is not refused and mismatches FSDP's
collectives; keep one forward per block there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer_core.parallel.tensors import local_tensor
from trainer_core.ranks.coordination import raised_together
from trainer_core.ranks.logical_gradients import LogicalGradients
from trainer_core.ranks.rng import caller_streams_kept, model_device
from trainer_core.ranks.topology import Topology
from trainer_core.training.checkpoints import Checkpoint
from trainer_core.training.memory import BACKWARD_STATES, BackwardMode
from trainer_core.training.transaction import ranks_agree

from . import FullyShard
from .fold import OrderedFolds

__all__ = ["ShardedLogicalGradients"]


class ShardedLogicalGradients:
    """The deterministic reduction of a sharded trainer over logical ranks (module docstring)."""

    backward_is_collective = True
    for_sharded_model = True
    canonical_norm = True
    mode = "deterministic"
    deterministic = True

    def __init__(self, trainer, topology: Topology, *, empty_mode: BackwardMode = "retain"):
        parallelism = trainer.parallelism
        if not isinstance(parallelism, FullyShard):
            raise ValueError("ShardedLogicalGradients reduces a sharded model; an unsharded one uses LogicalGradients")
        if topology.assignment != "round_robin":
            raise ValueError(
                "a sharded model runs its logical ranks round-robin (every process's j-th in lockstep); "
                "pass dataclasses.replace(topology, assignment='round_robin')"
            )
        self._trainer = trainer
        self.topology = topology
        self.empty_mode: BackwardMode = empty_mode
        self.folds = OrderedFolds(parallelism.sharded)
        self._heads = LogicalGradients(trainer, topology, "deterministic", replicated_only=True)
        self.active: int | None = None
        """The logical rank whose block runs now, or None."""
        self._turns = 0
        self._pending = False
        self._dummy = False
        self._forwards = 0
        """Forwards run in the active block so far (its first one exchanges its mode: `begin_forward`)."""

    # -- a logical rank's block --------------------------------------------------------

    @contextlib.contextmanager
    def scope(self, logical_rank: int) -> Iterator[None]:
        """Run `logical_rank`'s one backward (or none: then a dummy one runs at the end, an empty turn)."""
        with self._heads.scope(logical_rank):
            self.active, self._turns, self._forwards = logical_rank, 0, 0
            try:
                yield
                if self._turns == 0:
                    self._empty_turn()
            finally:
                self.active = None

    def _empty_turn(self) -> None:
        if self.topology.world_size == 1:
            # No peer waits in a collective; the unsharded fold adds this logical rank's zeros: +0 in place.
            with torch.no_grad():
                for param in self._sharded_parameters():
                    if param.grad is not None:
                        local_tensor(param.grad).add_(0.0)
            return
        # Every unit must reduce in lockstep with the peers' real turn: a 2-token forward/backward whose chunks the
        # fold sends as +0 (a loss times zero could still carry NaN or -0.0).
        device = model_device(self._trainer.model)
        ids = torch.zeros((1, 2), dtype=torch.long, device=device)
        self._dummy = True
        try:
            # The block's seeded streams are gone by now: the dummy's dropout must not draw from the caller's
            # (one process would then shuffle its next batch from another stream than its peers and W = 1).
            with caller_streams_kept(device):
                out = self._trainer.forward(ids, outputs=("logprobs",), mode=self.empty_mode)
                assert out.logprobs is not None
                self._trainer.backward(out.logprobs.sum())
        finally:
            self._dummy = False

    def _sharded_parameters(self) -> Iterator[torch.Tensor]:
        for checkpoint in self._trainer.checkpoints.values():
            for param in checkpoint.parameters().values():
                if isinstance(param, DTensor):
                    yield param

    # -- the trainer's GradientReduction ----------------------------------------------

    def begin_forward(self, mode: BackwardMode | None) -> None:
        """Before a forward's first collective: refuse one whose collectives the peers' blocks would not match.

        At W > 1 the first forward of every process's block (the dummy's included) exchanges its mode; forwards
        that would gather differently (a replay beside retain or offload, a no_grad forward beside one with grad)
        are refused on every process alike. `mode` None: a forward under no_grad.
        """
        if self.active is None or self.topology.world_size == 1:
            return
        self._forwards += 1
        if self._forwards > 1:
            return
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.active, mode, self._dummy))
        if len({_gathers(peer_mode) for _, peer_mode, _ in gathered}) > 1:
            runs = "; ".join(_describe(*peer) for peer in gathered)
            raise raised_together(
                ValueError(
                    "on a sharded model every process's j-th logical rank runs in lockstep with its peers' (FSDP's "
                    f"collectives), so their forwards must gather alike, but {runs}. A replay gathers the weights "
                    "again in its backward, retain and offload do not, and a no_grad forward has no backward. "
                    f"Beside an empty logical rank run the real blocks in its empty_mode={self.empty_mode!r} "
                    "(retain or offload), or pass their mode as empty_mode (train.forward_mode in the pipeline) — "
                    "refused before any collective of this turn"
                )
            )

    def begin_backward(self) -> None:
        if self.active is None:
            raise ValueError(
                "backward ran outside any logical rank, so its gradient belongs to none; run it inside "
                "`with shard:` (logical-DP facade) — nothing was accumulated"
            )
        if self._turns:
            raise ValueError(
                f"a second backward inside logical rank {self.active}: on a sharded model each logical rank's "
                "block runs one backward (sum the losses and backward once) — nothing was accumulated"
            )
        self._pending = True  # counted once committed: an aborted turn may be retried in the same block
        if self.topology.world_size > 1:
            self.folds.begin(empty=self._dummy)

    def agree_on_backward(self, error: BaseException | None) -> BaseException | None:
        error = ranks_agree(error)  # the turn is collective: every process commits it, or none
        if self._pending and error is None:
            self._turns += 1
        self._pending = False
        if self.folds.in_turn:
            if error is None:
                self.folds.commit()
            else:
                self.folds.abort()
        return error

    def check_ready(self) -> None:
        """Refuse a step inside a logical rank, or with replicated gradients outside any logical rank."""
        self._heads.check_ready()

    def local_flags(self, checkpoints: Sequence[Checkpoint]) -> list[list[bool]]:
        heads = self._heads.local_flags(checkpoints)  # also refuses a step inside a logical rank
        return [
            [
                (param.grad is not None) if isinstance(param, DTensor) else head
                for param, head in zip(checkpoint.parameters().values(), per, strict=True)
            ]
            for checkpoint, per in zip(checkpoints, heads, strict=True)
        ]

    def reduce(self, checkpoints: Sequence[Checkpoint], anywhere: Sequence[Sequence[bool]]) -> None:
        left_out = [
            name
            for name, checkpoint in self._trainer.checkpoints.items()
            if all(checkpoint is not c for c in checkpoints)
            and any(p.grad is not None for p in checkpoint.parameters().values())
        ]
        if left_out:
            raise ValueError(
                f"step() leaves out checkpoint(s) {left_out} holding sharded fold gradients; on a sharded model "
                "with logical ranks step every checkpoint together (or zero_grad first)"
            )
        sharded, replicated = [], []
        for checkpoint, flags in zip(checkpoints, anywhere, strict=True):
            kinds = [isinstance(p, DTensor) for p in checkpoint.parameters().values()]
            sharded.append([f and k for f, k in zip(flags, kinds, strict=True)])
            replicated.append([f and not k for f, k in zip(flags, kinds, strict=True)])
        for checkpoint, flags in zip(checkpoints, sharded, strict=True):
            checkpoint.gather_gradients(flags)  # the fold's global sum is already there: nothing to add
        self._heads.reduce(checkpoints, replicated)
        self.folds.reset()

    def clear(self) -> None:
        self._heads.clear()
        self.folds.reset()


def _gathers(mode: BackwardMode | None) -> str:
    """What a forward of `mode` does collectively: its backward replays it, keeps what it saved, or there is none."""
    if mode is None:
        return "no backward"
    return "replays" if BACKWARD_STATES[mode].replays else "saved"


def _describe(logical_rank: int, mode: BackwardMode | None, dummy: bool) -> str:
    what = "a forward under no_grad" if mode is None else f"mode={mode!r}"
    dummy_note = " (the dummy forward/backward of its empty block: empty_mode)" if dummy else ""
    return f"logical rank {logical_rank} runs {what}{dummy_note}"
