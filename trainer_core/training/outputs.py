"""What a forward computes: the model run and the outputs derived from it (logprobs, top-k, logits, hidden, heads).

One function, `compute_outputs`, serves the original forward and every replay,
so a replay computes exactly what the forward did. Log-probabilities are
computed in float32 or wider: a bf16 model gets float32 logprobs, a float64
model keeps float64.

A model whose vocabulary was padded (to a multiple, for kernels or sharding)
computes logits over the padded rows; every output is taken over the true
vocabulary only (`vocab_size`), so the padding rows never reach a softmax, a
logprob or a gradient.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class OutputSpec:
    """One output a forward can give, under both of its names."""

    kind: str
    """Its name in `compute_outputs` and on the wire between ranks' graphs (`ForwardCall.outputs`, graph leaves)."""
    field: str
    """Its `ManagedOutputs` field, and its name in the logical ranks' commands."""
    differentiable: bool = True
    """A managed output the loss can depend on (the top-k ids are indices: not a leaf)."""
    importance_weighted: bool = False
    """A stale replay at the current weights scales its cotangent by the importance weight."""
    recorded: bool = False
    """A replay keeps the forward's value (for the importance weight, and the top-k ids it gathers at)."""


OUTPUTS = (
    OutputSpec("logprobs", "logprobs", importance_weighted=True, recorded=True),
    OutputSpec("topk", "topk_logprobs", importance_weighted=True, recorded=True),
    OutputSpec("topk_ids", "topk_ids", differentiable=False, recorded=True),
    OutputSpec("logits", "logits"),
    OutputSpec("hidden", "hidden_states"),
)
"""Every output but the heads, in the order fields are listed and sent."""
HEAD_PREFIX = "head:"
"""A head's output is `head:NAME`, under both names."""
OUTPUT_KINDS = (*(spec.kind for spec in OUTPUTS if spec.differentiable), "heads")
"""What a forward can be asked for (`outputs=`)."""
SPECS = {spec.kind: spec for spec in OUTPUTS}
FIELDS = tuple(spec.field for spec in OUTPUTS)
FIELD_OF = {spec.kind: spec.field for spec in OUTPUTS}
IMPORTANCE_WEIGHTED = frozenset(spec.kind for spec in OUTPUTS if spec.importance_weighted)
RECORDED = tuple(spec.kind for spec in OUTPUTS if spec.recorded)
_NOT_LEAVES = frozenset(spec.field for spec in OUTPUTS if not spec.differentiable)


def is_leaf_field(field: str) -> bool:
    """Whether the output under this field (or `head:NAME`) is a managed leaf the loss can depend on."""
    return field not in _NOT_LEAVES


@dataclass(frozen=True)
class ForwardCall:
    """What a forward was asked for; enough to run it again."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    targets: torch.Tensor | None
    outputs: tuple[str, ...]
    top_k: int
    adapter: str | None = None
    """The LoRA adapter active in this forward (None: the model has none); a replay activates it again."""

    def __post_init__(self) -> None:
        unknown = set(self.outputs) - set(OUTPUT_KINDS)
        if unknown:
            raise ValueError(f"unknown outputs {sorted(unknown)}; choose from {OUTPUT_KINDS}")
        if "topk" in self.outputs and self.top_k <= 0:
            raise ValueError("outputs include 'topk' but top_k=0; pass top_k=K")

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.input_ids, self.attention_mask, self.position_ids, self.targets) if t is not None]

    @property
    def nbytes(self) -> int:
        """Bytes of the input tensors: what a replay keeps."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def copied(self) -> "ForwardCall":
        """A call over private copies of the inputs: the caller may refill its buffers after the forward."""

        def copy(tensor):
            return None if tensor is None else tensor.detach().clone()

        return replace(
            self,
            input_ids=copy(self.input_ids),
            attention_mask=copy(self.attention_mask),
            position_ids=copy(self.position_ids),
            targets=copy(self.targets),
        )


def _logprob_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def compute_outputs(
    model: nn.Module,
    heads: Mapping[str, nn.Module],
    call: ForwardCall,
    topk_ids: torch.Tensor | None = None,
    vocab_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """Run the model on the call's inputs and derive the requested outputs.

    Keys: `logprobs`, `topk` (+ `topk_ids`), `logits`, `hidden`, `head:NAME`.
    With `topk_ids` (a replay), the top-k entries are gathered at those ids
    instead of chosen again, so their cotangents land on the same tokens even
    when the weights moved since the forward. With `vocab_size`, logits past it
    (padding rows of the vocabulary) are cut off first.
    """
    wants = set(call.outputs)
    need_hidden = "hidden" in wants or ("heads" in wants and bool(heads))
    # use_cache=False whatever the model's config says (most say true): a training forward has no use for a KV
    # cache, and with one transformers skips its packing detection, so packed documents would attend to each other.
    kwargs = dict(
        input_ids=call.input_ids, attention_mask=call.attention_mask, output_hidden_states=need_hidden, use_cache=False
    )
    if call.position_ids is not None:
        kwargs["position_ids"] = call.position_ids
    result = model(**kwargs)
    logits = result.logits
    if vocab_size is not None and logits.shape[-1] > vocab_size:
        logits = logits[..., :vocab_size]
    targets = call.targets if call.targets is not None else call.input_ids[:, 1:]
    target_logits = logits if call.targets is not None else logits[:, :-1]
    out: dict[str, torch.Tensor] = {}
    if "logits" in wants:
        out["logits"] = logits
    if "logprobs" in wants:
        vocab = target_logits.shape[-1]
        # cross_entropy is fused and saves only the logits, unlike log_softmax + gather.
        flat = target_logits.reshape(-1, vocab).to(_logprob_dtype(target_logits))
        nll = F.cross_entropy(flat, targets.reshape(-1), reduction="none", ignore_index=-100)
        out["logprobs"] = -nll.view(targets.shape)
    if "topk" in wants:
        logprobs = torch.log_softmax(target_logits.to(_logprob_dtype(target_logits)), dim=-1)
        if topk_ids is None:
            values, ids = logprobs.topk(call.top_k, dim=-1)
        else:
            values, ids = logprobs.gather(-1, topk_ids), topk_ids
        out["topk"], out["topk_ids"] = values, ids
    if need_hidden:
        hidden = result.hidden_states[-1]
        if "hidden" in wants:
            out["hidden"] = hidden
        for name, head in heads.items() if "heads" in wants else ():
            out[HEAD_PREFIX + name] = head(hidden)
    return out
