"""The `Parallelism` protocol: what the trainer library asks of the way a model is spread over the processes.

The trainer library (`trainer_core.training`) never names a parallelism: it
holds one of these (`Trainer(model, parallelism=...)`, `Replicated()` by
default) and asks it. Each implementation is one class under this package,
chosen by `train.sharding` from `PARALLELISMS` (`__init__`):

- `Replicated` (`replicated.py`): every rank holds the whole model; plain
  autograd, gradients summed over ranks at the step.
- `FullyShard` (`fsdp/`): FSDP2 units; parameters, gradients and AdamW
  state are this rank's shards; forward and backward are collectives.

What a parallelism answers, and why the trainer needs it:

- *the model on the processes*: `model`, and `wrap` to build one around a
  model every rank built the same way;
- *a parameter's place*: `manages(param)`, whether the engine holds the
  parameter object (then it must not be replaced, and its gradient is summed
  inside backward); `compute_dtype(weight)`, the dtype the forward reads it in;
  `weight_storages()`, the storages of the whole weights the engine gathers
  (a graph's saved tensor on one is a weight, not an activation);
- *stale graphs*: `snapshot(params)`, what a graph differentiated after the
  step needs to see the weights it was recorded at (None: the checkpoint
  detaches its revision, the replicated way);
- *the gradient sum*: `reduces_in_backward` (the engine sums its gradients
  inside every backward, a collective) and `check_reduction`, which refuses a
  reduction that would sum them again;
- *recovery*: `recover_after_failed_pass`, after an exception aborted a
  forward or a backward midway (every rank calls it);
- *state and export*: `shards_weights`, whether each rank holds only its
  part of the weights and AdamW state (every rank saves and exports its own);
- *LoRA*: `adopts_injected_adapters`, whether adapters are injected before
  the model is wrapped (the engine holds the parameters: peft cannot add any
  afterwards) and adopted by name.

Tensor-level questions (a gradient's local part, a distributed norm's whole
value, autograd to a distributed parameter) need no object: `tensors.py` and
`autograd.py` answer them for every parallelism.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any, ClassVar, Protocol

import torch
from torch import nn


class WeightSnapshot(Protocol):
    """Some parameters' values at one revision, for a stale graph's backward (every rank holds the same ones)."""

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds for the snapshot."""
        ...

    def swapped_in(self) -> AbstractContextManager[None]:
        """While inside, the forward and backward read the snapshot's values (collective: every rank swaps)."""
        ...


class Parallelism(Protocol):
    """How a model is spread over the processes (see the module docstring for what each answer is for)."""

    name: ClassVar[str]
    """Its `train.sharding` name, the key in `PARALLELISMS`."""
    reduces_in_backward: ClassVar[bool]
    """Whether the engine sums its parameters' gradients over ranks inside every backward (a collective)."""
    adopts_injected_adapters: ClassVar[bool]
    """Whether LoRA adapters are injected before `wrap` and adopted by name (the engine holds the parameters)."""
    shards_weights: ClassVar[bool]
    """Whether each rank holds only its shards of the weights and AdamW state (config: `train.shards_weights`):
    every rank then saves and exports its own part; otherwise every rank holds them whole and one writes."""

    @property
    def model(self) -> nn.Module:
        """The model, as every rank runs it (wrapped in place)."""
        ...

    @classmethod
    def wrap(cls, model: nn.Module, mesh: Any, *, param_dtype: torch.dtype | None = None) -> Parallelism:
        """Spread `model` (the same on every rank) over the processes of `mesh`, in place. Collective."""
        ...

    def manages(self, param: torch.Tensor) -> bool:
        """Whether the engine holds this parameter object (it must not be replaced; its gradient is reduced in
        backward); False for a parameter outside the wrapped model (a head) and for every replicated one."""
        ...

    def compute_dtype(self, weight: torch.Tensor) -> torch.dtype:
        """The dtype the forward reads `weight` in (a mixed-precision gather's, else the weight's own)."""
        ...

    def weight_storages(self) -> frozenset[int]:
        """StorageImpl ids (`untyped_storage()._cdata`) of the whole weights the engine gathers, stable for the
        model's life while their `data_ptr` moves; empty when nothing is gathered."""
        ...

    def snapshot(self, params: Iterable[torch.Tensor]) -> WeightSnapshot | None:
        """What a graph differentiated after the coming step needs to read `params` at their current values;
        None when the checkpoint keeps its revision itself (`Checkpoint.detach_revision`)."""
        ...

    def check_reduction(self, reduction: object) -> None:
        """ValueError naming the right ones when `reduction` cannot sum this parallelism's gradients."""
        ...

    def recover_after_failed_pass(self) -> None:
        """Leave the model as before a forward or backward an exception aborted midway (every rank calls it)."""
        ...
