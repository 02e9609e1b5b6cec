"""What every backward state is: record a forward, say its resident bytes, differentiate, release.

A backward state is one object per forward, of one of the classes registered
in `BACKWARD_STATES` (`memory/__init__.py`), so a graph is never half one mode
and half another. What differs between modes is said by the class: its name
(`mode`), whether it runs the forward again in backward (`replays`), how it
records a forward (`record`, given a `ForwardRecording`), the evidence it
reports to the planner, and its answers to the planner's cost model (see
`costs.py` and `planner.py`). The trainer gives `differentiate`:

- `inputs`: the tensors to differentiate with respect to (the weights the
  gradient is taken at);
- `cotangents_for`: a function from the graph's outputs to their cotangents
  (the identity for a fresh graph; a replay at current weights scales the
  logprob cotangents by the importance weight, which needs the replayed outputs);
- `keep_graph`: keep the saved tensors after this backward (retain_graph, or a
  transaction that might still be retried);
- `rerun`: how to run the forward again, which parameters it reads at
  their current values on purpose, and the outputs it must reproduce bitwise
  (used by replay only).

A graph whose outputs the loss uses lead back to no trainable parameter is an
error in every mode, as it is in plain PyTorch ("does not require grad"), never
an empty gradient. Errors a state raises about itself are `BackwardStateError`s;
the trainer names the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from torch import nn

from ...parallel import gradients as parallel_gradients
from ..outputs import ForwardCall
from .costs import Evidence, OffloadTarget, PlanInputs
from .timing import Stopwatch

BackwardMode = str
"""A key of `BACKWARD_STATES`."""

Outputs = Mapping[str, torch.Tensor]
CotangentsFor = Callable[[Outputs], Mapping[str, torch.Tensor]]
Gradients = tuple["torch.Tensor | None", ...]


@dataclass(frozen=True)
class Rerun:
    """How a replay runs the forward again."""

    run: Callable[[ForwardCall, "torch.Tensor | None"], dict[str, torch.Tensor]]
    """Run the model on a call (the second argument: the top-k ids to gather at)."""
    current_parameter_ids: frozenset[int] = frozenset()
    """Parameters whose in-place changes since the forward are expected: read at their current values on
    purpose (a stale graph under the importance policy), or not read at all (an adapter the forward did not run)."""
    expected: Mapping[str, torch.Tensor] | None = None
    """The forward's outputs the replay must reproduce bit for bit (None: it runs at other weights on purpose)."""


@dataclass(frozen=True)
class ForwardRecording:
    """What a state's `record` is given: the forward to run and what it runs over. Built once per forward by the
    trainer; the lists are functions so that a mode that does not need them does not pay for them."""

    call: ForwardCall
    run: Callable[[ForwardCall], dict[str, torch.Tensor]]
    """Run the model on a call (untimed)."""
    watch: Stopwatch
    """Times `timed()` (enabled while the planner measures)."""
    modules: Callable[[], list[nn.Module]]
    parameters: Callable[[], list[torch.Tensor]]
    parameter_storages: Callable[[], set[int]]
    offload_target: OffloadTarget
    """Where an offloading state moves its saved tensors."""
    measuring: bool
    """Whether the planner measures: time copies and count bytes."""
    weight_impls: Callable[[], frozenset[int]] = frozenset
    """StorageImpl ids (`untyped_storage()._cdata`) of weights whose `data_ptr` moves: a sharded model's
    unsharded parameters, freed after forward and allocated again for backward (`Parallelism.weight_storages`).
    A saved tensor on one of them is a weight: referenced, not copied, and not counted."""

    def timed(self) -> dict[str, torch.Tensor]:
        """The forward, timed by `watch`."""
        with self.watch:
            return self.run(self.call)


class BackwardStateError(RuntimeError):
    """A graph's backward state cannot give its gradient; the message says why (the trainer adds which graph)."""


class NoGradientPathError(BackwardStateError):
    """The outputs a loss uses lead back to no trainable parameter."""


class BackwardState(Protocol):
    mode: ClassVar[str]
    """The name the config, `Trainer.forward(mode=...)` and the planner's records use."""
    replays: ClassVar[bool]
    """Runs the forward again in backward: it may run at the current weights (a stale graph under the importance
    policy), has `recorded_outputs`, and a failed backward leaves it as it was."""
    is_default: ClassVar[bool]
    """The planner's choice with no budget, or when its graph fits the budget (exactly one class)."""
    planned: ClassVar[bool]
    """Whether the planner considers it (False: a mode only chosen by name)."""
    exploration_rank: ClassVar[int | None]
    """With no evidence yet, the available class of lowest rank is chosen (None: never to explore)."""

    @classmethod
    def record(cls, forward: ForwardRecording) -> tuple["BackwardState", dict[str, torch.Tensor]]:
        """Run the forward in this mode: the state and the forward's outputs."""
        ...

    def forward_evidence(self, forward_s: float) -> Evidence:
        """What the forward just recorded measured (`forward_s`: the watch's seconds); called while measuring."""
        ...

    def backward_evidence(self) -> Evidence:
        """What the backward just run measured; called while measuring."""
        ...

    def stale_replay_stash(self):
        """Where a replay kept for this graph (importance policy) puts its input copies (None: on the device)."""
        ...

    # -- the planner's cost model (classmethods of PlanInputs) --

    @classmethod
    def available(cls, inputs: PlanInputs) -> bool:
        """Whether this mode can keep within the budget here."""
        ...

    @classmethod
    def planned_bytes(cls, inputs: PlanInputs) -> float:
        """Resident bytes the graph adds, as the planner predicts them."""
        ...

    @classmethod
    def extra_seconds(cls, inputs: PlanInputs) -> float:
        """What this mode costs over retaining, in seconds (with evidence)."""
        ...

    @classmethod
    def placement(cls, inputs: PlanInputs) -> OffloadTarget | None:
        """Where its tensors go (an offload target; None: they stay)."""
        ...

    # Besides, as `planner.choose` reads them: the default has DefaultMode's members, every other planned mode
    # AlternativeMode's, and the `last_resort` one (exactly one: chosen when no other is available) also
    # `last_resort_reason(inputs)`.

    @property
    def saved_bytes(self) -> int:
        """Bytes this graph keeps resident on the device until it is released."""
        ...

    @property
    def freed_by_backward(self) -> bool:
        """Whether autograd has run through its saved tensors without keeping them: even a backward that then
        failed may have freed some, so the graph cannot be differentiated again (never true of a replay)."""
        ...

    def differentiate(
        self, inputs: Sequence[torch.Tensor], cotangents_for: CotangentsFor, *, keep_graph: bool, rerun: Rerun
    ) -> Gradients: ...

    def release(self) -> None: ...


class ReplayingState(BackwardState, Protocol):
    """A state whose `replays` is set: it also has the outputs its forward recorded."""

    @property
    def recorded_outputs(self) -> dict[str, torch.Tensor]: ...


class DefaultMode(BackwardState, Protocol):
    """What `planner.choose` reads of the default mode (`is_default`), besides BackwardState."""

    no_budget_reason: ClassVar[str]
    fits_reason: ClassVar[str]

    @classmethod
    def budgeted_bytes(cls, inputs: PlanInputs) -> float:
        """The graph's resident bytes, with the estimate's headroom."""
        ...


class AlternativeMode(BackwardState, Protocol):
    """What `planner.choose` reads of every other planned mode, besides BackwardState."""

    exploration_reason: ClassVar[str]
    cheaper_reason: ClassVar[str]
    cost_key: ClassVar[str]
    """Its cost's name in the planner's records."""
    tie_rank: ClassVar[int]
    """Of equal costs, the lower wins."""
    last_resort: ClassVar[bool]

    @classmethod
    def unavailable_reason(cls, inputs: PlanInputs) -> str:
        """Why it cannot keep within the budget here."""
        ...


def differentiable_outputs(outputs: Outputs, cotangents: Mapping[str, torch.Tensor]) -> list[str]:
    """The outputs with a cotangent that lead back to a parameter; raises when none does."""
    names = [name for name in cotangents if outputs[name].requires_grad]
    if cotangents and not names:
        raise NoGradientPathError(
            f"the outputs the loss uses ({', '.join(cotangents)}) reach no trainable parameter: the forward read "
            "only frozen weights, or the model turned grad off inside its forward; nothing was accumulated — "
            "register the weights that should train, or leave these outputs out of the loss"
        )
    return names


def gradients(
    outputs: Outputs,
    cotangents: Mapping[str, torch.Tensor],
    names: Sequence[str],
    inputs: Sequence[torch.Tensor],
    keep_graph: bool,
) -> Gradients:
    """Autograd from the outputs `names` (see `differentiable_outputs`) to `inputs`.

    Inputs that are sharded parameters get this rank's shard of the gradient summed over ranks, reduced by their
    engine inside the backward (`parallel.autograd.gradients`): a collective, like the forward was."""
    if not names or not inputs:
        return tuple(None for _ in inputs)
    return parallel_gradients(
        [outputs[n] for n in names], [cotangents[n] for n in names], list(inputs), retain_graph=keep_graph
    )


def inplace_error(what: str, shape: tuple[int, ...], recorded: int, now: int) -> RuntimeError:
    """PyTorch's own error for a saved tensor changed in place, for the states that keep values outside autograd."""
    return RuntimeError(
        f"one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{what} {list(shape)}] is at version {now}; expected version {recorded} instead. Do not change "
        "parameters in place between a forward and its backward (or run the forward again)."
    )
