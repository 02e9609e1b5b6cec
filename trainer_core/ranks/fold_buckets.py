"""The deterministic fold overlapped with a step's last backward: buckets sent while autograd still runs.

Plain data parallelism hides its all-reduce behind backward (torch DDP sends a
bucket of gradients as soon as autograd has produced them). The ordered fold
(`reduction.sharded_ordered_fold`) can do the same for the last backward of a
step, the one that completes this process's partial gradients: a `FoldRound`,
opened by the step's loop (`steps.train_step`) around its logical ranks'
work, puts a hook on every parameter for the backward that loop marks as its
last (`final_backward`). When every gradient of a bucket has arrived, and
every bucket before it has gone, the bucket's [W, L/W, chunk] partials
(`flat_partials.pack_partials`) leave in an asynchronous all-to-all. At the
step, each bucket is folded in logical-rank order and all-gathered; the bits
are those of the fold at the step, since the fold is element-wise.

What a hook saw is a guess about what the backward will publish (it is
transactional: staged, validated, agreed, only then committed), so a round
is used only when every process vouches for it:

- every bucket leaves exactly once a round, in index order, on a process
  group of its own (`LogicalGradients` opens it), so processes stay matched
  whatever else they send and whichever backwards they ran: the buckets a
  hook did not send go when the round closes, from the committed partials.
  Folded (from a hook once its exchange is done, or at the step), each is
  gathered on a second group, again once a round and in index order;
- a process vouches for its round when its marked backward succeeded, each
  hooked gradient arrived once and is the very tensor the backward published
  (the accumulator keeps the staged gradient's storage: a second contribution,
  a copy or another graph's term would not), no backward ran after it, and
  at the vote each of those accumulators is still the one committed, not
  edited in place (its version counter) nor cleared;
- at the step every process votes (one all-reduce on the round's group);
  one vote against and every process drops the round and folds at the step
  as without it. A round never stepped is dropped when the next one opens.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .flat_partials import Key, assign_folded, pack_partials
from .reduction import all_gather_single, in_logical_order, ordered_fold
from .topology import Topology

BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb


@dataclass(eq=False)
class _Member:
    key: Key
    param: torch.nn.Parameter
    optimized: torch.Tensor


@dataclass(eq=False)
class _Bucket:
    members: list[_Member]
    dtype: torch.dtype
    waiting: set[Key] = field(default_factory=set)
    exchange: dist.Work | None = None
    sent: torch.Tensor | None = None
    received: torch.Tensor | None = None
    gathered: torch.Tensor | None = None
    gather: dist.Work | None = None


def buckets_of(members: Sequence[_Member], bucket_bytes: int | None = None) -> list[_Bucket]:
    """Members in reverse order (the order backward produces them), cut into buckets of one dtype each."""
    bucket_bytes = bucket_bytes or BUCKET_BYTES
    buckets: list[_Bucket] = []
    size = 0
    for member in reversed(members):
        dtype = member.optimized.dtype
        if not buckets or buckets[-1].dtype != dtype or size >= bucket_bytes:
            buckets.append(_Bucket([], dtype))
            size = 0
        buckets[-1].members.append(member)
        size += member.param.numel() * dtype.itemsize
    return buckets


class FoldRound:
    """One step's buckets: sent during the marked last backward or at the round's close, folded at the step."""

    def __init__(
        self,
        members: Sequence[_Member],
        topology: Topology,
        groups: tuple[dist.ProcessGroup, dist.ProcessGroup],
        partials: Callable[[], Mapping[int, Mapping[Key, torch.Tensor]]],
    ):
        """`groups`: the exchanges' (and the vote's) and the gathers' process groups, each used in the same order on
        every process; `partials()`: each local logical rank's committed partial gradients, read when a bucket
        leaves."""
        self.topology = topology
        self.group, self.gather_group = groups
        self._partials = partials
        self.buckets = buckets_of(members)
        self._bucket_of = {member.key: bucket for bucket in self.buckets for member in bucket.members}
        self.launched = 0
        self.vouched = True
        self.closed = False
        self._watching: int | None = None
        self._arrived: dict[Key, torch.Tensor] = {}
        self._arrived_storage: dict[Key, int] = {}
        # What the marked backward committed for what the hooks sent: (logical rank, {key: (accumulator, version)}),
        # checked again at the vote (an in-place edit or a cleared gradient after the backward is caught there).
        self._committed: tuple[int, dict[Key, tuple[torch.Tensor | None, int]]] | None = None
        self._lock = threading.Lock()  # hooks of parameters on several devices run on autograd's device threads
        self.sent_in_backward = 0  # buckets sent from hooks, whose values must turn out to be the published ones

    # -- the marked backward ------------------------------------------------------------------------

    @contextlib.contextmanager
    def watch(self, logical_rank: int) -> Iterator[None]:
        """Hook every member for one backward of `logical_rank`, the last this process runs before the step."""
        if self.closed or self._watching is not None or self._arrived:
            self.vouched = False  # a second marked backward: its hooks would send what the first already sent
            yield
            return
        self._watching = logical_rank
        for bucket in self.buckets[self.launched :]:
            bucket.waiting = {member.key for member in bucket.members if member.param.requires_grad}
        handles = [
            member.param.register_hook(self._hook(member))
            for bucket in self.buckets
            for member in bucket.members
            if member.param.requires_grad
        ]
        ok = False
        try:
            yield
            ok = True
        finally:
            for handle in handles:
                handle.remove()
            self._watching = None
            self.vouched = self.vouched and ok and self._published_what_was_sent()
            if self.vouched and self.sent_in_backward:
                self._committed = (logical_rank, self._accumulators_sent())

    def _hook(self, member: _Member) -> Callable[[torch.Tensor], None]:
        def arrived(grad: torch.Tensor) -> None:
            try:
                with self._lock:
                    self._arrive(member, grad)
            except Exception:  # noqa: BLE001 - never fail the backward: the round is only a guess, dropped at the vote
                self.vouched = False

        return arrived

    def _arrive(self, member: _Member, grad: torch.Tensor) -> None:
        if member.key in self._arrived:
            self.vouched = False  # a second term: the published sum is not what a bucket holds
            return
        existing = member.param.grad  # the logical rank's accumulator (`LogicalGradients.scope` swapped it in)
        grad = grad.detach()
        # The commit's accumulator is `grad + existing` (`transaction.new_accumulator`): IEEE addition commutes.
        self._arrived[member.key] = grad if existing is None else torch.add(existing, grad)
        self._arrived_storage[member.key] = grad.untyped_storage().data_ptr()
        bucket = self._bucket_of[member.key]
        bucket.waiting.discard(member.key)
        while self.launched < len(self.buckets) and not self.buckets[self.launched].waiting:
            self._send(self.buckets[self.launched], from_hooks=True)
            # Buckets whose exchange is done are folded and gathered now, while autograd still has work to do: in
            # index order, the first not yet done stopping the rest (the gathers pair up by their order).
            for earlier in self.buckets[: self.launched - 1]:
                if earlier.gather is not None:
                    continue
                if earlier.exchange is None or not earlier.exchange.is_completed():
                    break
                self._fold(earlier)

    def _published_what_was_sent(self) -> bool:
        """Each sent gradient is the one the backward committed: the accumulator adopted its storage."""
        for bucket in self.buckets[: self.sent_in_backward]:
            for member in bucket.members:
                grad, storage = member.param.grad, self._arrived_storage.get(member.key)
                if storage is None:  # nothing arrived (a frozen parameter): the bucket held zeros for it
                    if grad is not None:
                        return False
                elif grad is None or grad.untyped_storage().data_ptr() != storage:
                    return False
        return True

    def _accumulators_sent(self) -> dict[Key, tuple[torch.Tensor | None, int]]:
        sent = {}
        for bucket in self.buckets[: self.sent_in_backward]:
            for member in bucket.members:
                grad = member.param.grad
                sent[member.key] = (grad, -1 if grad is None else grad._version)
        return sent

    def _still_committed(self) -> bool:
        """The watched logical rank's partials are still what its marked backward committed (same tensors, not
        edited in place since, none cleared)."""
        if self._committed is None:
            return not self.sent_in_backward
        logical_rank, sent = self._committed
        partial = self._partials()[logical_rank]
        for key, (tensor, version) in sent.items():
            current = partial.get(key)
            if current is not tensor or (tensor is not None and tensor._version != version):
                return False
        return True

    def backward_began(self) -> None:
        """Any backward after the marked one, or after the close, changes partials already sent."""
        if self.closed or (self.sent_in_backward and self._watching is None):
            self.vouched = False

    # -- sending, folding ---------------------------------------------------------------------------

    def _send(self, bucket: _Bucket, *, from_hooks: bool) -> None:
        committed = self._partials()
        rows = []
        for logical_rank in self.topology.local_logical_ranks:
            if from_hooks and logical_rank == self._watching:
                rows.append(self._arrived)
            else:
                rows.append(committed[logical_rank])
        members = [(member.key, member.param.numel()) for member in bucket.members]
        device = bucket.members[0].optimized.device
        bucket.sent = pack_partials(members, rows, self.topology.world_size, bucket.dtype, device)
        bucket.received = torch.empty_like(bucket.sent)
        bucket.exchange = dist.all_to_all_single(bucket.received, bucket.sent, group=self.group, async_op=True)
        self.launched += 1
        if from_hooks:
            self.sent_in_backward = self.launched

    def close(self, ok: bool) -> None:
        """Send every bucket not yet sent (from the committed partials), so each process sent each bucket once."""
        if self.closed:
            return
        self.vouched = self.vouched and ok
        self._arrived.clear()
        while self.launched < len(self.buckets):
            self._send(self.buckets[self.launched], from_hooks=False)
        self.closed = True

    def covers(self, keys: Iterable[Key]) -> bool:
        return all(key in self._bucket_of for key in keys)

    def vote(self) -> bool:
        """Whether every process vouches for its round (a collective on the round's group)."""
        self.vouched = self.vouched and self._still_committed()
        ballot = torch.tensor(
            [1 if self.vouched else 0], dtype=torch.int32, device=self.buckets[0].members[0].optimized.device
        )
        dist.all_reduce(ballot, op=dist.ReduceOp.MIN, group=self.group)
        return bool(ballot.item())

    def drop(self) -> None:
        """Finish the round's messages unused: every bucket is exchanged, folded and gathered once on every process
        (another process may have gathered some from its hooks), so the next round's messages pair up."""
        for bucket in self.buckets:
            if bucket.gather is None:
                self._fold(bucket)
        for bucket in self.buckets:
            assert bucket.gather is not None
            bucket.gather.wait()
            bucket.exchange = bucket.gather = bucket.sent = bucket.received = bucket.gathered = None

    def _fold(self, bucket: _Bucket) -> None:
        """Fold the bucket's received slice in logical order and start gathering every process's folded slice.

        Every process folds and gathers its buckets in index order (from a hook when the exchange is already done,
        else at the step), so the gathers pair up on the round's group like the exchanges."""
        assert bucket.exchange is not None and bucket.received is not None, "a bucket folded before it was sent"
        bucket.exchange.wait()
        folded_slice = ordered_fold(in_logical_order(bucket.received, self.topology))
        size = self.topology.world_size * folded_slice.numel()
        bucket.gathered = torch.empty(size, dtype=bucket.dtype, device=folded_slice.device)
        bucket.gather = all_gather_single(bucket.gathered, folded_slice, group=self.gather_group, async_op=True)
        bucket.sent = bucket.received = None

    def fold_into(self, takes: Callable[[Key], bool]) -> None:
        """Fold every bucket in logical order and give each member for which `takes(key)` its sum as `.grad`."""
        for bucket in self.buckets:
            if bucket.gather is None:
                self._fold(bucket)
        for bucket in self.buckets:
            assert bucket.gather is not None and bucket.gathered is not None
            bucket.gather.wait()
            assign_folded([(member.optimized, takes(member.key)) for member in bucket.members], bucket.gathered)
            bucket.exchange = bucket.gather = bucket.gathered = None
