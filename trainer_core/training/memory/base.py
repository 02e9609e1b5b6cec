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
- `rerun`: how to run the forward again, and which parameters it reads at
  their current values on purpose (used by replay only).
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


class BackwardState(Protocol):
    mode: ClassVar[BackwardMode]

    @property
    def saved_bytes(self) -> int:
        """Bytes this graph keeps resident on the device until it is released."""

    @property
    def survives_failed_backward(self) -> bool:
        """Whether a backward that ran without keep_graph leaves it differentiable (only a replay does)."""

    def differentiate(self, inputs: Sequence[torch.Tensor], cotangents_for: CotangentsFor, *, keep_graph: bool,
                      rerun: Rerun) -> Gradients: ...

    def release(self) -> None: ...


def gradients(outputs: Outputs, cotangents: Mapping[str, torch.Tensor], inputs: Sequence[torch.Tensor],
              keep_graph: bool) -> Gradients:
    names = [name for name in cotangents if outputs[name].requires_grad]
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
