"""The rank-zero facade: one driver on rank 0 calls the trainer as if it were one process; every rank does the work.

    def rl_loop(trainer):                      # written for one process
        for batch in batches:
            out = trainer.forward(batch["input_ids"], batch["attention_mask"])
            loss = policy_loss(out.logprobs, batch)        # over the whole global batch, on rank 0
            trainer.backward(loss)
            trainer.step()

    run_rank_zero(trainer, topology, rl_loop, seed=run_seed)   # on every rank; rl_loop runs on rank 0 only

`forward` splits the global batch over the L logical ranks
(`logical_row_ranges`) and each rank runs its own; the outputs come back to
rank 0 concatenated in logical order, as managed tensors of this facade.
`backward` takes the cotangents of those outputs on rank 0 and sends each
logical rank its rows, to the rank that owns the graph. The step folds the
logical ranks' gradients in logical order, so the same loop gives bitwise the
same weights and losses at W = 1 (no process group at all), 2 or 4.
`save`, `load`, `export` and `call` (a custom callback on every rank) are
commands too; `checkpoints` and `model` are rank 0's replicas, to read.

A command that fails on any rank fails the driver on rank 0 with the failing
rank and its error named (its own error when rank 0 failed), and then every
other rank (`abort`); an exception in the driver itself stops every rank the
same way. After a failure the facade refuses further commands. A failed
backward is not retried here: unlike `Trainer.backward` on one process, its
graphs may be gone on the ranks that did run.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from ..training.graphs import GraphConsumedError, ManagedOutputs, leaf_tag, loss_leaves, make_leaf
from ..training.outputs import is_leaf_field
from ..training.trainer import BackwardReport
from .channel import ABORT, CLOSE, gather_outcomes, receive_command, send_command
from .commands import ROW_INPUTS, Command, CommandExecutor
from .coordination import RankFailure, coordinated_error, describe, primary_failures
from .logical_gradients import LogicalGradients, ReductionMode
from .topology import Topology

T = TypeVar("T")


@dataclass
class _Forward:
    row_ranges: list[range]
    live_outputs: int = 0
    consumed: bool = False


@dataclass
class _Session:
    forwards: dict[int, _Forward] = field(default_factory=dict)
    released: list[int] = field(default_factory=list)
    next_forward_id: int = 0


class RankZeroTrainer:
    """The Trainer API on rank 0 over the global batch: forward, backward, step, save, load, export, call."""

    def __init__(self, executor: CommandExecutor, topology: Topology):
        self._executor = executor
        self.topology = topology
        self._token = uuid.uuid4().hex
        self._session = _Session()
        self.failure: BaseException | None = None
        """The failure that stopped the facade (every later command refuses), or None."""
        self._failures: tuple[str, list[tuple[int, str]]] | None = None
        self._stopped = False

    @property
    def checkpoints(self):
        """Rank 0's checkpoints (every rank holds the same); read them, change them only through commands."""
        return self._executor.trainer.checkpoints

    @property
    def model(self):
        return self._executor.trainer.model

    # -- one command -------------------------------------------------------------------

    def _run(self, name: str, options: dict, payloads: list[Any] | None = None) -> list[Any]:
        if self.failure is not None or self._stopped:
            raise RankFailure(name, [(0, f"the facade stopped after an earlier failure ({self.failure})")])
        command = Command(name, options, tuple(self._session.released))
        self._session.released.clear()
        payload = send_command(command, payloads or [None] * self.topology.world_size, self.topology)
        outcomes = gather_outcomes(self._executor.execute(command, payload), self.topology)
        assert outcomes is not None  # the facade runs on rank 0, where gather_outcomes returns every rank's
        failures = primary_failures([(rank, status) for rank, (status, _) in enumerate(outcomes) if status is not None])
        if failures:
            self._failures = (name, failures)
            self.failure = coordinated_error(name, self._executor.last_error, failures)
            raise self.failure
        return [result for _, result in outcomes]

    # -- the Trainer API ---------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        targets: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **options,
    ) -> ManagedOutputs:
        """`Trainer.forward` over the global batch; `options` (outputs, top_k, mode, …) go to every rank's trainer."""
        given = (input_ids, attention_mask, targets, position_ids)
        rows = {name: tensor for name, tensor in zip(ROW_INPUTS, given, strict=True) if tensor is not None}
        num_rows = input_ids.shape[0]
        mismatched = {name: tuple(t.shape) for name, t in rows.items() if t.shape[0] != num_rows}
        if mismatched or num_rows == 0:
            raise ValueError(
                f"forward needs at least one row and the same rows in every input ({mismatched or 'no rows'})"
            )
        ranges = self.topology.logical_row_ranges(num_rows)
        payloads: list[dict] = [{} for _ in range(self.topology.world_size)]
        for logical_rank, span in enumerate(ranges):
            if len(span):  # a logical rank without rows runs no forward and owns no graph
                owner = self.topology.owner_of(logical_rank)
                # A clone: a pickled slice would carry its whole storage to the other rank.
                payloads[owner][logical_rank] = {
                    name: (t[span.start : span.stop] if owner == 0 else t[span.start : span.stop].clone())
                    for name, t in rows.items()
                }
        grad = torch.is_grad_enabled()
        session = self._session
        forward_id = session.next_forward_id
        session.next_forward_id += 1
        results = self._run("forward", {"forward_id": forward_id, "grad": grad, "kwargs": options}, payloads)
        per_logical = {rank: fields for per_rank in results for rank, fields in per_rank.items()}
        versions = {name: checkpoint.version for name, checkpoint in self.checkpoints.items()}
        return self._managed(forward_id, ranges, [per_logical[rank] for rank in sorted(per_logical)], grad, versions)

    def _managed(
        self, forward_id: int, ranges: list[range], per_logical: list[dict], grad: bool, versions: dict
    ) -> ManagedOutputs:
        managed = ManagedOutputs(graph_id=forward_id if grad else None, versions=versions)
        leaves = []
        for name in per_logical[0]:
            value = torch.cat([fields[name] for fields in per_logical])  # logical order
            if grad and is_leaf_field(name):
                value = make_leaf(value, self._token, forward_id, name)
                leaves.append(value)
            managed.set_field(name, value)
        if grad:
            record = _Forward(ranges, live_outputs=len(leaves))
            self._session.forwards[forward_id] = record
            for leaf in leaves:
                weakref.finalize(leaf, _output_dropped, weakref.ref(self._session), forward_id)
        return managed

    def backward(
        self, loss: torch.Tensor, gradient: torch.Tensor | None = None, *, retain_graph: bool = False
    ) -> BackwardReport:
        """`Trainer.backward`: the loss's cotangents on this facade's outputs go to the ranks that own the graphs."""
        found = loss_leaves(loss, self._token)
        if found.foreign or found.others:
            raise ValueError(
                "in the rank-zero facade a loss may depend only on this facade's forward outputs (it found "
                f"{len(found.foreign)} other trainer output(s) and {len(found.others)} other tensor(s) that "
                "require grad); detach them — nothing was accumulated"
            )
        if not found.managed:
            raise ValueError("the loss depends on no managed output; build it from the outputs of trainer.forward(...)")
        forward_ids = sorted({leaf_tag(leaf)[0] for leaf in found.managed})
        for forward_id in forward_ids:
            if self._session.forwards[forward_id].consumed:
                raise GraphConsumedError(
                    f"graph {forward_id} was already used by a backward; pass retain_graph=True to backward it again"
                )
        cotangents = torch.autograd.grad(
            loss, found.managed, grad_outputs=gradient, retain_graph=retain_graph, allow_unused=True
        )
        payloads: list[dict] = [{} for _ in range(self.topology.world_size)]
        for leaf, cotangent in zip(found.managed, cotangents):
            if cotangent is None:
                continue
            forward_id, name = leaf_tag(leaf)
            for logical_rank, span in enumerate(self._session.forwards[forward_id].row_ranges):
                if len(span):
                    owner = self.topology.owner_of(logical_rank)
                    piece = cotangent[span.start : span.stop]
                    payloads[owner].setdefault(logical_rank, {})[(forward_id, name)] = (
                        piece if owner == 0 else piece.clone()
                    )
        results = self._run("backward", {"retain_graph": retain_graph}, payloads)
        if not retain_graph:
            for forward_id in forward_ids:
                self._session.forwards[forward_id].consumed = True
        ages: dict[int, dict[str, int]] = {}
        num_gradients = 0
        for per_rank in results:
            for logical_ages, count in per_rank.values():
                ages.update(logical_ages)
                num_gradients = max(num_gradients, count)
        return BackwardReport(len(forward_ids), ages, num_gradients)

    def step(
        self,
        names: Iterable[str] | None = None,
        *,
        learning_rate: float | None = None,
        schedule_step: int | None = None,
    ) -> dict:
        """`Trainer.step` on every rank; returns rank 0's reports (every rank's are the same)."""
        options = {
            "names": None if names is None else list(names),
            "learning_rate": learning_rate,
            "schedule_step": schedule_step,
        }
        return self._run("step", options)[0]

    def save(self, state_dir: Path | str, meta: dict) -> int:
        """Write the training state (rank 0); returns its size in bytes."""
        return self._run("save", {"state_dir": str(state_dir), "meta": meta})[0]

    def load(self, state_dir: Path | str, *, with_optimizer: bool = True) -> dict:
        """Restore the training state on every rank; returns its meta."""
        return self._run("load", {"state_dir": str(state_dir), "with_optimizer": with_optimizer})[0]

    def export(self, out_dir: Path | str, names: Iterable[str] | None = None) -> list[str]:
        """Every rank checks that all hold the same weights; rank 0 writes each checkpoint under `out_dir/NAME`."""
        return self._run("export", {"out_dir": str(out_dir), "names": None if names is None else list(names)})[0]

    def call(self, fn: Callable[..., T], *args, **kwargs) -> list[T]:
        """Run `fn(RankContext, *args, **kwargs)` on every rank (a module-level function); returns each rank's value."""
        return self._run("call", {"fn": fn, "args": args, "kwargs": kwargs})

    # -- ending the session -----------------------------------------------------------

    def _abort(self, error: BaseException) -> None:
        """Tell every rank to raise: the failure a command saw, or else the driver's own error (rank 0's)."""
        if self._stopped:
            return
        self._stopped = True
        command, failures = self._failures or ("driver", [(0, describe(error))])
        self._send_end(Command(ABORT, {"command": command, "failures": failures}))

    def _close(self) -> None:
        if self._stopped:
            return
        if self.failure is not None:
            self._abort(self.failure)
            return
        self._stopped = True
        self._send_end(Command(CLOSE))

    def _send_end(self, command: Command) -> None:
        send_command(command, [None] * self.topology.world_size, self.topology)


def _output_dropped(session_ref: weakref.ref, forward_id: int) -> None:
    """A facade output was garbage-collected; when a forward has none left, every rank frees its graph."""
    session = session_ref()
    if session is None:
        return
    record = session.forwards.get(forward_id)
    if record is None:
        return
    record.live_outputs -= 1
    if record.live_outputs <= 0:
        del session.forwards[forward_id]
        session.released.append(forward_id)


def serve_commands(executor: CommandExecutor, topology: Topology) -> None:
    """On a rank other than 0: run rank 0's commands until it closes the session; raise when it aborts."""
    while True:
        command, payload = receive_command(topology)
        if command.name == CLOSE:
            return
        if command.name == ABORT:
            failures = [tuple(failure) for failure in command.options["failures"]]
            own = executor.last_error if topology.rank in {rank for rank, _ in failures} else None
            raise coordinated_error(command.options["command"], own, failures)
        gather_outcomes(executor.execute(command, payload), topology)


def run_rank_zero(
    trainer,
    topology: Topology,
    driver: Callable[[RankZeroTrainer], T],
    *,
    reduction: ReductionMode = "deterministic",
    seed: int = 0,
) -> T | None:
    """Call on every rank: rank 0 runs `driver(facade)` and returns its value; the others serve its commands (None).

    Installs the logical-rank gradient reduction on `trainer`. With W = 1 and
    no process group this runs the driver in-process: the plain one-process run.
    """
    gradients = LogicalGradients(trainer, topology, reduction)
    trainer.gradient_reduction = gradients
    executor = CommandExecutor(trainer, topology, gradients, seed)
    if topology.rank != 0:
        serve_commands(executor, topology)
        return None
    facade = RankZeroTrainer(executor, topology)
    try:
        result = driver(facade)
    except BaseException as error:
        if facade.failure is None:
            error.add_note("the driver failed on rank 0, every rank stopped")
        try:
            facade._abort(error)
        except Exception as unsent:  # noqa: BLE001 - the peers are gone already; the driver's error is the story
            error.add_note(f"could not tell the other ranks to stop: {describe(unsent)}")
        raise
    facade._close()
    return result
