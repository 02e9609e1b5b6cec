"""What every backward state is: record a forward, say its resident bytes, differentiate, release.

A backward state is one object per forward, of one of three types —
`RetainedGraph`, `OffloadedGraph`, `ReplayedGraph` — so a graph is never half
one mode and half another. The trainer gives `differentiate`:

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
from typing import ClassVar, Literal, Protocol

import torch

from ..outputs import ForwardCall

BackwardMode = Literal["retain", "offload", "replay"]
BACKWARD_MODES: tuple[str, ...] = ("retain", "offload", "replay")

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


class BackwardStateError(RuntimeError):
    """A graph's backward state cannot give its gradient; the message says why (the trainer adds which graph)."""


class NoGradientPathError(BackwardStateError):
    """The outputs a loss uses lead back to no trainable parameter."""


class BackwardState(Protocol):
    mode: ClassVar[BackwardMode]

    @property
    def saved_bytes(self) -> int:
        """Bytes this graph keeps resident on the device until it is released."""

    @property
    def freed_by_backward(self) -> bool:
        """Whether autograd has run through its saved tensors without keeping them: even a backward that then
        failed may have freed some, so the graph cannot be differentiated again (never true of a replay)."""

    def differentiate(self, inputs: Sequence[torch.Tensor], cotangents_for: CotangentsFor, *, keep_graph: bool,
                      rerun: Rerun) -> Gradients: ...

    def release(self) -> None: ...


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


def gradients(outputs: Outputs, cotangents: Mapping[str, torch.Tensor], names: Sequence[str],
              inputs: Sequence[torch.Tensor], keep_graph: bool) -> Gradients:
    """Autograd from the outputs `names` (see `differentiable_outputs`) to `inputs`."""
    if not names or not inputs:
        return tuple(None for _ in inputs)
    return torch.autograd.grad([outputs[n] for n in names], list(inputs), grad_outputs=[cotangents[n] for n in names],
                               retain_graph=keep_graph, allow_unused=True)


def inplace_error(what: str, shape: tuple[int, ...], recorded: int, now: int) -> RuntimeError:
    """PyTorch's own error for a saved tensor changed in place, for the states that keep values outside autograd."""
    return RuntimeError(
        f"one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{what} {list(shape)}] is at version {now}; expected version {recorded} instead. Do not change "
        "parameters in place between a forward and its backward (or run the forward again)."
    )
