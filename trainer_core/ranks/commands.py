"""The rank-zero facade's commands, as every rank runs them over the logical ranks it owns.

Rank 0's driver sends each command with a per-rank payload (`channel`); every
rank, rank 0 included, runs it here and returns `(status, result)` — a local
failure is reported as a status, never raised, so the rank still answers and
no peer waits on it. Commands whose work contains collectives (`step`,
`export`) exchange their outcome first (`coordination.exchange`), so no rank
enters those collectives alone.

| command  | on each rank                                                                 | result to rank 0 |
|----------|------------------------------------------------------------------------------|------------------|
| forward  | per local logical rank with rows, under its own RNG seeded (seed, forward id, logical rank): `trainer.forward`; outputs kept for backward | each logical rank's outputs |
| backward | per local logical rank with cotangents, inside that logical rank: one backward of Σ(output · cotangent) | ages, gradient counts |
| step     | `trainer.step` (the logical reduction folds every logical rank's gradient in order) | step reports |
| save     | rank 0 writes the training state                                             | bytes written |
| load     | every rank restores the training state                                       | the state's meta |
| export   | every rank digests its weights; all must agree; rank 0 writes each checkpoint's inference form | files written |
| call     | `fn(RankContext, *args, **kwargs)`                                           | fn's value |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer_core.run.faults import maybe_inject_command_fault
from trainer_core.run.state import load_training_state, save_training_state

from ..files import tensors_sha256
from ..training.checkpoint_io import export_checkpoint_module
from ..training.graphs import ManagedOutputs
from .coordination import describe, exchange, reportable
from .logical_gradients import LogicalGradients
from .rng import logical_rank_rng, model_device
from .topology import Topology, step_seed

ROW_INPUTS = ("input_ids", "attention_mask", "targets", "position_ids")
"""Forward arguments with the batch in dimension 0: split over logical ranks."""
_COLLECTIVE_RUNS = frozenset({"step"})
"""Commands whose work after the exchange holds collectives (the step's reduction): see `coordination.reportable`."""


@dataclass(frozen=True)
class Command:
    name: str
    options: dict = field(default_factory=dict)
    released: tuple[int, ...] = ()
    """Forward ids whose outputs rank 0 dropped: every rank frees their graphs."""


@dataclass(frozen=True)
class RankContext:
    """What a custom callback (`RankZeroTrainer.call`) receives on every rank."""

    trainer: Any
    topology: Topology


def output_fields(out: ManagedOutputs) -> dict[str, torch.Tensor]:
    """A forward's outputs by field name (`head:NAME` for heads), detached."""
    return {name: tensor.detach() for name, tensor in out.fields().items()}


class CommandExecutor:
    """Runs commands on one rank; holds the outputs of its logical ranks' forwards until rank 0 drops them."""

    def __init__(self, trainer, topology: Topology, gradients: LogicalGradients, seed: int):
        self.trainer = trainer
        self.topology = topology
        self.gradients = gradients
        self.seed = seed
        self._outputs: dict[int, dict[int, ManagedOutputs]] = {}
        self.last_error: BaseException | None = None
        """This rank's error in the last command (re-raised, with a note, when rank 0 aborts)."""
        # (work before the exchange, work after it — None: the command has no exchange)
        self._handlers: dict[str, tuple[Callable, Callable | None]] = {
            "forward": (self._forward, None),
            "backward": (self._backward, None),
            "step": (self._prepare_step, self._step),
            "save": (self._save, None),
            "load": (self._load, None),
            "export": (self._digest, self._export),
            "call": (self._call, None),
        }

    def execute(self, command: Command, payload: Any) -> tuple[str | None, Any]:
        """Run one command; returns (None, result) or (the error as one line, None)."""
        for forward_id in command.released:
            self._outputs.pop(forward_id, None)
        prepare, run = self._handlers[command.name]
        error, result = None, None
        # BaseException: a KeyboardInterrupt here is reported like any failure, so rank 0 hears of it and aborts
        # every rank (this one re-raises it then, `serve_commands`), instead of losing the rank mid-command.
        try:
            maybe_inject_command_fault(command.name, self.topology.rank)
            result = prepare(command.options, payload)
        except BaseException as failure:  # noqa: BLE001 - reported to rank 0, which stops every rank
            if not reportable(failure):
                raise
            error = failure
        if run is not None:
            try:
                prepared = exchange(command.name, error, result)  # raises on every rank if any failed
                result = run(command.options, result, prepared)
            except BaseException as failure:  # noqa: BLE001
                if not reportable(failure, collectives=command.name in _COLLECTIVE_RUNS):
                    raise
                error = failure
        self.last_error = error
        return (None, result) if error is None else (describe(error), None)

    # -- handlers --------------------------------------------------------------------

    def _forward(
        self, options: dict, payload: dict[int, dict[str, torch.Tensor]]
    ) -> dict[int, dict[str, torch.Tensor]]:
        forward_id, grad = options["forward_id"], options["grad"]
        results = {}
        device = model_device(self.trainer.model)
        for logical_rank in sorted(payload):
            rows = payload[logical_rank]
            # Seeded per logical rank; on rank 0 the driver's own streams come back as they were.
            seed = step_seed(self.seed, forward_id, logical_rank)
            with logical_rank_rng(seed, device), torch.set_grad_enabled(grad):
                out = self.trainer.forward(
                    rows["input_ids"],
                    rows.get("attention_mask"),
                    targets=rows.get("targets"),
                    position_ids=rows.get("position_ids"),
                    **options["kwargs"],
                )
            if out.graph_id is not None:
                self._outputs.setdefault(forward_id, {})[logical_rank] = out
            results[logical_rank] = output_fields(out)
        return results

    def _backward(self, options: dict, payload: dict[int, dict[tuple[int, str], torch.Tensor]]) -> dict[int, tuple]:
        reports = {}
        for logical_rank in sorted(payload):
            items = sorted(payload[logical_rank].items(), key=lambda item: item[0])
            outputs = {}
            for (forward_id, _), _ in items:
                held = self._outputs.get(forward_id, {}).get(logical_rank)
                if held is None:
                    raise RuntimeError(
                        f"forward {forward_id} of logical rank {logical_rank} holds no graph here "
                        "(its outputs were dropped); run the forward again"
                    )
                outputs[forward_id] = held
            with self.gradients.scope(logical_rank):
                # d/d(output) of Σ(output · cotangent) is the cotangent itself, bit for bit.
                surrogate = sum(
                    (outputs[forward_id].get_field(name) * cotangent).sum() for (forward_id, name), cotangent in items
                )
                report = self.trainer.backward(surrogate, retain_graph=options["retain_graph"])
            ages = {forward_id: report.ages.get(out.graph_id, {}) for forward_id, out in outputs.items()}
            reports[logical_rank] = (ages, report.num_gradients)
        return reports

    def _prepare_step(self, options: dict, payload: None) -> None:
        self.gradients.check_ready()

    def _step(self, options: dict, prepared: None, peers: list) -> dict:
        return self.trainer.step(
            options["names"], learning_rate=options["learning_rate"], schedule_step=options.get("schedule_step")
        )

    def _save(self, options: dict, payload: None) -> int:
        if self.topology.rank != 0:
            return 0
        return save_training_state(Path(options["state_dir"]), self.trainer.checkpoints, options["meta"])

    def _load(self, options: dict, payload: None) -> dict:
        self._outputs.clear()  # restored checkpoints have new identities: old graphs cannot be differentiated
        return load_training_state(
            Path(options["state_dir"]), self.trainer.checkpoints, with_optimizer=options["with_optimizer"]
        )

    def _digest(self, options: dict, payload: None) -> str:
        return tensors_sha256(
            {
                f"{checkpoint.name}/{name}": param.detach()
                for checkpoint in self.trainer.checkpoints.values()
                for name, param in checkpoint.parameters().items()
            }
        )

    def _export(self, options: dict, digest: str, digests: list[str]) -> list[str]:
        disagreeing = [rank for rank, other in enumerate(digests) if other != digests[0]]
        if disagreeing:
            raise RuntimeError(f"ranks {disagreeing} hold weights that differ from rank 0's; refusing to export")
        if self.topology.rank != 0:
            return []
        out_dir = Path(options["out_dir"])
        return [
            f"{name}/{file}"
            for name in options["names"] or list(self.trainer.checkpoints)
            for file in export_checkpoint_module(self.trainer, name, out_dir / name)
        ]

    def _call(self, options: dict, payload: None) -> Any:
        return options["fn"](RankContext(self.trainer, self.topology), *options["args"], **options["kwargs"])
