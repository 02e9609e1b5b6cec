"""Block activation checkpointing: each decoder layer saves only its input and runs its forward again in backward.

`checkpoint_blocks(model)` makes every decoder layer (the model's
`_no_split_modules` classes) run under `torch.utils.checkpoint`, non-reentrant,
with the RNG state preserved: the forward keeps the layer's inputs, and
backward recomputes the layer (about one more forward per block) to get the
tensors a plain forward would have saved. Gradients are bitwise those of a
plain forward, dropout included.

The layer's `forward` is replaced on the instance, not the module wrapped, so
parameter names, `state_dict` keys (and so saved states and exports) are the
same with checkpointing on or off. It checkpoints in train and eval mode alike
(HF's own switch only in train mode), and never under `torch.no_grad()`, where
nothing is saved anyway.

A recompute must run the layer as its forward ran it, whatever happened in
between: an optimizer step hands the module fresh parameter tensors while a
stale graph keeps the old ones (`checkpoints.Checkpoint.detach_revision`), a
caller switches to `eval()` or to another LoRA adapter. So each checkpointed
call records the layer's parameter tensors and module state (references, no
copies) and the recompute runs with them restored; afterwards the layer is as
the caller had it.

The memory planner counts what a graph saves by walking its nodes
(`memory/retained.saved_tensor_bytes`). Inside a checkpointed layer the nodes
hold placeholders (reading one would recompute the layer), and what the layer
does keep, its inputs, hangs off no node of the graph. So the output's node
carries the inputs' storages in its metadata (`CHECKPOINTED_INPUTS`), and the
walk counts those and skips placeholders. A recompute outside a backward is
refused, so that no inspection of a graph can run a layer by accident.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .memory.module_state import ModuleState
from .memory.retained import CHECKPOINTED_INPUTS

ActivationCheckpointing = Literal["none", "blocks"]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: the modules whose class is one of its `_no_split_modules` (HF's block list)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer class (_no_split_modules); "
            'train.activation_checkpointing = "blocks" needs one: set it to "none"'
        )
    return layers


def checkpoint_blocks(model: nn.Module) -> int:
    """Checkpoint every decoder layer of `model` (a no-op for one already checkpointed); returns how many layers."""
    layers = decoder_layers(model)
    for layer in layers:
        if not isinstance(layer.__dict__.get("forward"), _CheckpointedForward):
            layer.forward = _CheckpointedForward(layer, layer.forward)
    return len(layers)


def is_checkpointed(model: nn.Module) -> bool:
    return any(isinstance(module.__dict__.get("forward"), _CheckpointedForward) for module in model.modules())


class _LayerStart:
    """What a checkpointed call ran with: every submodule's parameter tensors and module state (references)."""

    def __init__(self, layer: nn.Module):
        modules = list(layer.modules())
        self._parameters = [(module, dict(module._parameters)) for module in modules]
        self._state = ModuleState.capture(modules)

    def run(self, forward: Callable, *args, **kwargs):
        caller = [(module, dict(module._parameters)) for module, _ in self._parameters]
        try:
            for module, parameters in self._parameters:
                module._parameters.update(parameters)
            with self._state.restored():
                return forward(*args, **kwargs)
        finally:
            for module, parameters in caller:
                module._parameters.update(parameters)


class _CheckpointedForward:
    """A decoder layer's forward under non-reentrant activation checkpointing."""

    def __init__(self, layer: nn.Module, forward: Callable):
        self._layer = layer
        self._forward = forward

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self._forward(*args, **kwargs)
        start = _LayerStart(self._layer)
        first = [True]

        def run(*args, **kwargs):
            if first[0]:  # the forward itself
                first[0] = False
                return self._forward(*args, **kwargs)
            if torch._C._current_graph_task_id() == -1:
                raise RuntimeError(
                    "a checkpointed decoder layer was asked to recompute outside a backward (a saved tensor read "
                    "while inspecting the graph); it recomputes only in backward"
                )
            return start.run(self._forward, *args, **kwargs)

        output = checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
        _mark_inputs(output, _tensors((args, kwargs)))
        return output


def _tensors(value) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _mark_inputs(output, inputs: Iterable[torch.Tensor]) -> None:
    storages = tuple(
        {
            (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            for t in inputs
            if not isinstance(t, nn.Parameter)
        }
    )
    for tensor in _tensors(output):
        if tensor.grad_fn is not None:
            cast("dict", tensor.grad_fn.metadata)[CHECKPOINTED_INPUTS] = storages  # a property at run time
