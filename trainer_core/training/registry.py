"""Registering checkpoints on a model: the base weights, a peft LoRA adapter, custom heads — owned by identity.

Every parameter belongs to at most one checkpoint, decided by the Parameter
object, never by its name. Registering a LoRA adapter after the base
checkpoint keeps the base trainable (peft freezes everything but the adapter
when it injects one; the trainer turns the registered base back on), so both
train exactly as plain autograd on the peft model would. The other order is
refused: after peft froze the base, "every trainable parameter" no longer
means the base weights.

Several LoRA adapters can be registered (the reference design's slots). peft
runs only its *active* adapter, and activating one freezes the others; so
each forward activates the adapter it was asked for (`activate_adapter`, with
peft's own `set_adapter`) and turns every registered parameter back on, so an
adapter's live graphs still get their gradients while another is active.

On a model whose parallelism holds the parameters (a sharded one,
`Parallelism.adopts_injected_adapters`) peft cannot inject any more: its new
parameters would sit unsharded inside the engine's units. Its adapters are
injected before sharding (`lora_injection.inject_lora`, drawn as here), and
`add_lora_checkpoint` adopts the injected, now sharded, adapter by name. The
base stays frozen there (a base checkpoint beside adapters is refused); heads
(`add_module_checkpoint`) stay unsharded beside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
from torch import nn

from ..parallel import Parallelism, local_tensor
from .checkpoints import LOW_PRECISION, Checkpoint, OptimizerConfig
from .lora_injection import adapter_parameters, inject


class CheckpointRegistry:
    def __init__(self, model: nn.Module, parallelism: Parallelism):
        self.model = model
        self.parallelism = parallelism
        """How the model is spread over the processes (`trainer_core.parallel`)."""
        self.checkpoints: dict[str, Checkpoint] = {}
        self.heads: dict[str, nn.Module] = {}
        self._active_adapter: str | None = None

    def _add(self, checkpoint: Checkpoint) -> Checkpoint:
        if checkpoint.name in self.checkpoints:
            raise ValueError(f"a checkpoint named '{checkpoint.name}' is already registered; choose another name")
        owners = self.parameter_owners()
        for param_name, param in checkpoint.parameters().items():
            if id(param) in owners:
                owner, owner_name = owners[id(param)]
                raise ValueError(
                    f"checkpoint '{checkpoint.name}': parameter {param_name} already belongs to checkpoint "
                    f"'{owner}' (as {owner_name}); a parameter can train in one checkpoint only"
                )
        self.checkpoints[checkpoint.name] = checkpoint
        return checkpoint

    def add_base_checkpoint(self, name: str = "base", optimizer: OptimizerConfig = OptimizerConfig()) -> Checkpoint:
        """Full fine-tuning: every trainable parameter of the model that no other checkpoint owns."""
        injected = sorted(getattr(self.model, "peft_config", {}))
        if self.parallelism.adopts_injected_adapters and injected:
            raise ValueError(
                f"cannot register a base checkpoint on a sharded model with LoRA adapters ({', '.join(injected)}): "
                "inject_lora froze the base before sharding; a sharded LoRA run trains the adapters (and heads) "
                "over a frozen base — register the adapters with add_lora_checkpoint"
            )
        lora = [c.name for c in self.checkpoints.values() if c.kind == "lora"]
        if lora:
            raise ValueError(
                f"register the base checkpoint before the LoRA adapter '{lora[0]}': peft froze the base "
                "weights when it injected the adapter"
            )
        owners = self.parameter_owners()
        params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad and id(p) not in owners]
        return self._add(Checkpoint(name, "base", self.model, params, optimizer))

    def add_lora_checkpoint(self, name: str, lora_config, optimizer: OptimizerConfig = OptimizerConfig()) -> Checkpoint:
        """A LoRA adapter injected with peft. Weights no checkpoint owns stay frozen; registered ones keep training.

        On a sharded model the adapter was injected before sharding (`lora_injection.inject_lora`, with the same
        `lora_config`); this adopts its sharded parameters by name."""
        if name in self.checkpoints:
            raise ValueError(f"a checkpoint named '{name}' is already registered; choose another name")
        if self.parallelism.adopts_injected_adapters:
            adapter = self._injected_adapter(name, lora_config)
            # peft left the last injected adapter active; the newest registered one is, as unsharded.
            self._active_adapter = None
            self.activate_adapter(name)
            for _, param in adapter:
                param.requires_grad_(True)
        else:
            adapter = inject(self.model, name, lora_config, keep=self.parameter_owners())
            self._active_adapter = name  # peft activated the new adapter
            self._keep_registered_trainable()
        checkpoint = self._add(Checkpoint(name, "lora", self.model, adapter, optimizer))
        checkpoint.adapter_config = lora_config
        return checkpoint

    def _injected_adapter(self, name: str, lora_config) -> list[tuple[str, nn.Parameter]]:
        """The sharded parameters of adapter `name`, injected before `shard_model`; ValueError when it was not."""
        injected = getattr(self.model, "peft_config", {})
        if name not in injected:
            raise ValueError(
                f"cannot add LoRA adapter '{name}' to a sharded model: peft would inject unsharded parameters "
                f"into the sharded model's units; inject it before sharding (lora_injection.inject_lora(model, '{name}', "
                f"lora_config), then shard_model) and register it here by name (injected: {sorted(injected) or 'none'})"
            )
        if lora_config is not None and injected[name].to_dict() != lora_config.to_dict():
            raise ValueError(
                f"LoRA adapter '{name}' was injected with another config than the one given here; pass the config "
                "it was injected with (its adapter_config.json is written from this one)"
            )
        adapter = adapter_parameters(self.model, name)
        unsharded = [n for n, p in adapter if not self.parallelism.manages(p)]
        if unsharded:
            raise ValueError(
                f"LoRA adapter '{name}' is not sharded ({unsharded[0]} is a plain parameter): inject it before "
                "shard_model, which makes its parameters shards of their decoder layer's unit"
            )
        return adapter

    def add_module_checkpoint(
        self, name: str, module: nn.Module, optimizer: OptimizerConfig = OptimizerConfig()
    ) -> Checkpoint:
        """A custom head applied to the last hidden state; `out.heads[name]` is its output.

        Its parameters must be in the dtype the model computes in (the hidden states'): a ValueError says so before
        anything changes, rather than torch's dtype error in the first forward.
        """
        self._check_head_dtype(name, module)
        module.to(next(self.model.parameters()).device)
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        checkpoint = self._add(Checkpoint(name, "module", module, params, optimizer))
        self.heads[name] = module
        return checkpoint

    def _compute_dtype(self) -> torch.dtype | None:
        """The dtype of the model's hidden states: a sharded weight's all-gather dtype (a bf16 policy's bf16 over FP32
        masters), else the weights' own; the input embedding's, where the hidden states start. None: no float weight."""
        embeddings = getattr(self.model, "get_input_embeddings", lambda: None)()
        weight = getattr(embeddings, "weight", None)
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            weight = next((p for p in self.model.parameters() if p.is_floating_point()), None)
        if weight is None:
            return None
        return self.parallelism.compute_dtype(weight)

    def _check_head_dtype(self, name: str, module: nn.Module) -> None:
        dtype = self._compute_dtype()
        other = next(
            ((n, p.dtype) for n, p in module.named_parameters() if p.is_floating_point() and p.dtype != dtype), None
        )
        if dtype is None or other is None:
            return
        masters = " (it trains through FP32 master weights, as the model does)" if dtype in LOW_PRECISION else ""
        raise ValueError(
            f"head '{name}': its parameter {other[0]} is {other[1]}, and the model computes in {dtype} (the hidden "
            f"states the head takes); build the head in {dtype}: add_module_checkpoint({name!r}, "
            f"module.to({dtype})){masters}"
        )

    # -- adapter selection -----------------------------------------------------------

    def _keep_registered_trainable(self) -> None:
        """peft froze what it does not consider active; every registered checkpoint still trains."""
        for checkpoint in self.checkpoints.values():
            for param in checkpoint.parameters().values():
                param.requires_grad_(True)

    def selected_adapter(self, checkpoint: str | None) -> str | None:
        """The LoRA adapter a forward runs with: `checkpoint`, or the only one registered (None without adapters)."""
        adapters = [c.name for c in self.checkpoints.values() if c.kind == "lora"]
        if checkpoint is None:
            if len(adapters) > 1:
                raise ValueError(
                    f"{len(adapters)} LoRA adapters are registered ({', '.join(adapters)}); say which one "
                    "this forward runs with: forward(..., checkpoint=NAME)"
                )
            return adapters[0] if adapters else None
        if checkpoint not in self.checkpoints:
            raise ValueError(f"checkpoint={checkpoint!r} is not registered; registered: {sorted(self.checkpoints)}")
        if self.checkpoints[checkpoint].kind != "lora":
            raise ValueError(
                f"checkpoint={checkpoint!r} is a '{self.checkpoints[checkpoint].kind}' checkpoint; "
                f"forward(checkpoint=) selects a LoRA adapter ({', '.join(adapters) or 'none registered'}) "
                "— the base and the heads take part in every forward"
            )
        return checkpoint

    def activate_adapter(self, name: str | None) -> None:
        """Make `name` the adapter peft runs (a no-op when it already is, or without adapters)."""
        if name is None or name == self._active_adapter:
            return
        from peft.tuners.tuners_utils import set_adapter

        set_adapter(self.model, name)
        self._active_adapter = name
        self._keep_registered_trainable()

    # -- lookups ---------------------------------------------------------------------

    def parameter_owners(self) -> dict[int, tuple[str, str]]:
        """id(parameter) → (checkpoint name, parameter name), for every parameter a checkpoint owns."""
        return {id(p): (c.name, n) for c in self.checkpoints.values() for n, p in c.parameters().items()}

    def _all_parameters(self) -> list[torch.Tensor]:
        return [p for root in (self.model, *self.heads.values()) for p in root.parameters()]

    def _parameter_storages(self) -> set[int]:
        # A sharded parameter's storage is its local shard's.
        return {local_tensor(p).untyped_storage().data_ptr() for p in self._all_parameters()}

    @contextlib.contextmanager
    def weights_swapped_in(self, weights: Mapping[str, Mapping[str, torch.Tensor]]):
        """Run with each checkpoint's weights taken from `weights` (a snapshot) instead of the live ones."""
        with contextlib.ExitStack() as stack:
            for name, tensors in weights.items():
                stack.enter_context(self.checkpoints[name].swapped_in(tensors))
            yield
