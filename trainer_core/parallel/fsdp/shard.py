"""Shard a Hugging Face causal LM with FSDP2 (`torch.distributed.fsdp.fully_shard`), and snapshot its shards.

`FullyShard` (this package's `__init__`) is the parallelism built on it:
`Trainer(model, parallelism=FullyShard(shard_model(model, mesh)))`.

`shard_model` makes these FSDP units, bottom-up (torchtitan's layout, except
that every unit reshards after forward):

1. the input embedding;
2. each decoder layer (the modules whose class name is in
   `model._no_split_modules`, else `model.model.layers`);
3. the final norm and the lm_head, grouped (one unit, so the embedding and
   the head, the two largest tensors, are never unsharded together);
4. the root (whatever is left: rotary buffers hold no parameters).

A model with tied input and output embeddings keeps both in the root unit
(one parameter cannot live in two units).

Every unit:

- reshards after forward (`reshard_after_forward=True`, the root included).
  A stale graph's backward must gather its weights again, so that a
  `ShardSnapshot` swapped in around it is what the backward reads; a unit
  kept unsharded after forward would differentiate at whatever it holds;
- sums gradients over ranks (force-sum comms, divide factor 1): the trainer's
  loss is already divided by the global token count, so FSDP's default mean
  would divide by W twice. Gloo's SUM of W = 2 ranks is bitwise g0 + g1;
- under `param_dtype=torch.bfloat16`, keeps the FP32 sharded parameters as
  the masters (FSDP's `MixedPrecisionPolicy`: bf16 all-gather and compute,
  `reduce_dtype` reduction), so no second copy of the weights exists. Build
  the model in FP32 (`from_config` / `from_pretrained` in FP32 keep RoPE's
  `inv_freq` FP32, which the bitwise match with the unsharded bf16 run needs).

`shard_model` ends with a no-grad one-token forward (every rank must call it:
it all-gathers), so FSDP's lazy init has run and the unsharded parameter
objects exist; they are the same objects for the model's life, and
`ShardedModel.unsharded_storages` names their storages (the tensors a graph
saves that are FSDP's transient weights, not activations).

Private FSDP internals this module relies on (torch 2.13) are pinned by
`tests/trainer/test_fsdp_contract.py`: `fully_shard.state(unit)._fsdp_param_groups`,
`FSDPParam._sharded_param_data` (the flat padded local shard the all-gather
reads), `FSDPParam.param_dtype` and `FSDPParam.sharded_state`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState

__all__ = [
    "ShardSnapshot",
    "ShardedModel",
    "backward_to_shards",
    "decoder_layers",
    "fsdp_param_of",
    "fsdp_params",
    "shard_model",
    "shard_units",
]

# id(sharded parameter) → its FSDPParam, for every model `shard_model` sharded. Weak values: an entry lives as
# long as its FSDPParam, which holds the parameter, so an id here always names a live parameter.
_FSDP_PARAM_OF: weakref.WeakValueDictionary[int, FSDPParam] = weakref.WeakValueDictionary()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers FSDP shards one unit each; ValueError naming what was looked for when there are none."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers: list[nn.Module] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        # A layer class nested in another found layer belongs to that layer's unit.
        if type(module).__name__ in names and not any(name.startswith(prefix + ".") for prefix in inside):
            layers.append(module)
            inside.append(name)
    if not layers:
        fallback = getattr(getattr(model, "model", None), "layers", None)
        if isinstance(fallback, nn.ModuleList):
            layers = list(fallback)
    if not layers:
        raise ValueError(
            f"cannot shard {type(model).__name__}: no decoder layers found (no module whose class is in "
            f"_no_split_modules={sorted(names)}, and no model.model.layers); shard a Hugging Face causal LM "
            "or set _no_split_modules to its decoder layer class"
        )
    return layers


def _called(model: nn.Module, method: str) -> nn.Module | None:
    """`model.method()` for a Hugging Face accessor, None when the model has no such method or it returns none."""
    getter = getattr(model, method, None)
    found = getter() if callable(getter) else None
    return found if isinstance(found, nn.Module) else None


def _final_norm(model: nn.Module) -> nn.Module | None:
    decoder = _called(model, "get_decoder") or getattr(model, "model", None)
    norm = getattr(decoder, "norm", None)
    return norm if isinstance(norm, nn.Module) else None


def _embeddings(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """The input embedding and the lm_head, each None when the model has none or they share a weight (tied)."""
    embed, head = _called(model, "get_input_embeddings"), _called(model, "get_output_embeddings")
    if embed is not None and head is not None:
        embed_weights = {id(p) for p in embed.parameters()}
        if any(id(p) in embed_weights for p in head.parameters()):
            return None, None  # tied: both stay in the root unit
    return embed, head


def fsdp_params(model: nn.Module, params: Iterable[torch.Tensor] | None = None) -> list[FSDPParam]:
    """Every FSDPParam of a sharded model, in unit order, each once; only those of `params` (sharded) when given."""
    wanted = None if params is None else {id(p) for p in params}
    found: list[FSDPParam] = []
    seen_states: set[int] = set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = fully_shard.state(module)
        if id(state) in seen_states:  # a grouped unit ([norm, lm_head]) is one state over two modules
            continue
        seen_states.add(id(state))
        for group in state._fsdp_param_groups:
            found.extend(fp for fp in group.fsdp_params if wanted is None or id(fp.sharded_param) in wanted)
    return found


@dataclass(frozen=True)
class ShardedModel:
    """A model after `shard_model`: its FSDP units (each once, root last) and what FSDP holds for it."""

    model: nn.Module
    units: tuple[FSDPModule, ...]

    def fsdp_params(self, params: Iterable[torch.Tensor] | None = None) -> list[FSDPParam]:
        return fsdp_params(self.model, params)

    def unsharded_storages(self) -> frozenset[int]:
        """StorageImpl ids (`untyped_storage()._cdata`) of FSDP's unsharded parameters.

        Stable for the model's life (fsdp contract test), while their `data_ptr` is not: FSDP frees the storage
        after forward and allocates it again before backward. A graph's saved tensor in this set is a weight.
        """
        return frozenset(fp.unsharded_param.untyped_storage()._cdata for fp in self.fsdp_params())


def recover_after_failed_pass(sharded: ShardedModel) -> None:
    """Put FSDP back in a clean state after an exception aborted a forward or a backward midway (every rank).

    FSDP leaves the units the failed pass had gathered unsharded (`model.parameters()` then yields the gathered
    tensors), and the gradients autograd had already written on them in place: the next backward would add onto
    them. `FSDPModule.reset_iter_state` (torch's supported recovery) reshards every unit and clears its
    per-iteration state; the leftover unsharded gradients are dropped here. No collective. The failed pass's
    gradients are lost by design: the caller's transaction restores the committed ones.
    """
    root = sharded.units[-1]
    root.reset_iter_state()
    for fp in sharded.fsdp_params():
        if hasattr(fp, "_unsharded_param"):
            fp.unsharded_param.grad = None
        fp.unsharded_accumulated_grad = None


def shard_units(model: nn.Module, mesh: DeviceMesh, policy: MixedPrecisionPolicy) -> tuple[FSDPModule, ...]:
    """`fully_shard` `model` in place into the units of the module docstring, root last, without the lazy init.

    `shard_model` adds the lazy init; `fsdp.load` calls this on a meta-device model, where a forward cannot
    run. Raises ValueError, before anything is sharded, for a model whose decoder layers cannot be found.
    """
    layers = decoder_layers(model)
    embed, head = _embeddings(model)
    norm = _final_norm(model)

    def shard(module: nn.Module | list[nn.Module]) -> FSDPModule:
        # Every unit reshards after forward, the root too (FSDP's default keeps the root unsharded): see above.
        unit = fully_shard(module, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
        first = unit[0] if isinstance(unit, list) else unit
        first.set_force_sum_reduction_for_comms(True)
        first.set_gradient_divide_factor(1.0)
        return first

    units: list[FSDPModule] = []
    if embed is not None:
        units.append(shard(embed))
    units.extend(shard(layer) for layer in layers)
    head_group = [m for m in (norm, head) if m is not None]
    if head_group:
        units.append(shard(head_group))
    units.append(shard(model))
    return tuple(units)


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
) -> ShardedModel:
    """Apply `fully_shard` to `model` in place (units in the module docstring), then run FSDP's lazy init.

    Collective: every rank of `mesh` calls it with the same model. `param_dtype` is the all-gather and compute
    dtype (None: the parameters' own); `reduce_dtype` the gradient reduction's. Raises ValueError, before
    anything is sharded, for a model whose decoder layers cannot be found.
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    units = shard_units(model, mesh, policy)
    _lazy_init(model)
    _know_fsdp_params(model)
    return ShardedModel(model=model, units=units)


def _know_fsdp_params(model: nn.Module) -> None:
    """Make `fsdp_param_of` find each sharded parameter of `model` (after its lazy init: the final objects)."""
    for fp in fsdp_params(model):
        _FSDP_PARAM_OF[id(fp.sharded_param)] = fp


def fsdp_param_of(tensor: torch.Tensor) -> FSDPParam | None:
    """The FSDPParam whose sharded parameter `tensor` is (a model `shard_model` sharded), else None."""
    fp = _FSDP_PARAM_OF.get(id(tensor))
    return fp if fp is not None and fp.sharded_param is tensor else None


def backward_to_shards(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    retain_graph: bool,
) -> tuple[torch.Tensor | None, ...]:
    """`torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)` where inputs may be sharded params.

    Collective (FSDP reduce-scatters inside it): every rank calls it. `autograd.grad` w.r.t. a sharded
    parameter silently gives None (the graph's leaves are FSDP's unsharded parameters, and FSDP reduces only
    what `.backward()` accumulated into them), so this runs `torch.autograd.backward` into the unsharded
    leaves, lets FSDP reduce-scatter (SUM) into `sharded_param.grad`, and returns what arrived there: each
    sharded input's gradient is this rank's shard of the sum over ranks, a plain input's its own gradient.
    Every input's `.grad` is stashed and set to None first (FSDP then assigns the reduced shard instead of
    adding to it) and restored after, error or not, so the caller's accumulators are as they were.
    """
    owners = [fsdp_param_of(t) for t in inputs]
    leaves = [fp.unsharded_param if fp is not None else t for fp, t in zip(owners, inputs)]
    stash = [t.grad for t in inputs]
    try:
        for t in inputs:
            t.grad = None
        torch.autograd.backward(list(outputs), list(grad_outputs), retain_graph=retain_graph, inputs=leaves)
        return tuple(t.grad for t in inputs)
    finally:
        for fp in owners:
            if fp is not None:  # a backward that failed midway leaves no partial sum for the next one to add to
                fp.unsharded_param.grad = None
        for t, grad in zip(inputs, stash):
            t.grad = grad


def _lazy_init(model: nn.Module) -> None:
    """A no-grad one-token forward: FSDP's root lazy init and the first all-gather create the unsharded params."""
    device = next(model.parameters()).device
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    # Dropout in train mode would draw from the caller's RNG streams: the forward must leave them as they were.
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device], device_type=device.type):
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)


class ShardSnapshot:
    """The local shards of some FSDPParams at one revision, for a stale graph's backward to gather.

    FSDP frees a unit's gathered weights after forward and gathers the *current* shards again in backward, so a
    graph recorded before a step would be differentiated at the new weights (a wrong Jacobian). `capture` clones
    each `FSDPParam._sharded_param_data` (1/W of the weights) in the dtype the all-gather sends (bf16 under a bf16
    `MixedPrecisionPolicy`: bitwise the same gather at half the bytes); `swapped_in` points the FSDPParams at the
    clones for the stale graph's backward (or re-forward) and restores the live shards after, even on error.
    Nothing is copied by the swap and the live shards are not written: no version bump, no change to the weights.
    """

    def __init__(self, shards: dict[FSDPParam, torch.Tensor]) -> None:
        self._shards = shards

    @classmethod
    def capture(cls, params: Iterable[FSDPParam]) -> ShardSnapshot:
        shards = {}
        for fp in params:
            live = fp._sharded_param_data
            dtype = fp.param_dtype or live.dtype
            shards[fp] = live.detach().to(dtype=dtype, copy=True)
        return cls(shards)

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds for the snapshot."""
        return sum(t.numel() * t.element_size() for t in self._shards.values())

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """While inside, FSDP's all-gathers of these params read the snapshot (collective: every rank swaps)."""
        for fp, shard in self._shards.items():
            if fp.sharded_state is not ShardedState.SHARDED:
                # Unsharded (or resharded to a smaller mesh) the all-gather would not read the shard at all.
                raise RuntimeError(f"cannot swap a snapshot into {fp._param_fqn}: its unit is not resharded")
            if shard.shape != fp._sharded_param_data.shape:
                raise RuntimeError(
                    f"snapshot of {fp._param_fqn} has shape {tuple(shard.shape)}, the live shard "
                    f"{tuple(fp._sharded_param_data.shape)}"
                )
        live: list[tuple[FSDPParam, torch.Tensor]] = []
        try:
            for fp, shard in self._shards.items():
                live.append((fp, fp._sharded_param_data))
                fp._sharded_param_data = shard
            yield
        finally:
            for fp, data in reversed(live):
                fp._sharded_param_data = data
