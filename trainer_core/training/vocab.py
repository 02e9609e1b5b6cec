"""A padded vocabulary: embedding and output rows past the tokenizer's, for kernels and sharding, never seen outside.

`pad_vocabulary(model, multiple)` grows the input embedding and the output
projection (transformers' `resize_token_embeddings`, tied weights kept tied)
to a multiple of `multiple` rows and sets the new rows to zero. Nothing ever
moves them:

- the trainer takes every output over the true vocabulary only (the logits
  are cut before any softmax), so the padded output rows get a zero gradient;
- no token id reaches a padded input row, so its gradient is zero too;
- AdamW turns a zero gradient on a zero row with zero moments into a zero
  update, and weight decay of zero is zero: the rows stay bitwise zero.

An export writes the true vocabulary: `cut_to_true_vocab` cuts the rows,
and `true_vocab_config` sets `vocab_size` back while the config is written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def padded_size(vocab_size: int, multiple: int) -> int:
    return -(-vocab_size // multiple) * multiple


def _vocab_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters with one row per token: input embedding, output projection (and its bias)."""
    # `model` is a transformers model: torch's stubs type its methods, read through nn.Module.__getattr__,
    # as Tensor | Module, hence the ignores on these calls.
    found = [model.get_input_embeddings().weight]  # pyright: ignore[reportCallIssue]
    output = model.get_output_embeddings()  # pyright: ignore[reportCallIssue]
    if output is not None:
        found += [p for p in (output.weight, getattr(output, "bias", None)) if p is not None]
    distinct: dict[int, nn.Parameter] = {}
    for param in found:
        distinct.setdefault(id(param), param)
    return list(distinct.values())


def pad_vocabulary(model: nn.Module, multiple: int) -> int:
    """Pad the vocabulary rows to a multiple of `multiple` (zero rows); returns the true vocabulary size."""
    if multiple < 1:
        raise ValueError(f"pad the vocabulary to a multiple of {multiple}? choose a positive multiple such as 64")
    # transformers methods, typed Tensor | Module by torch's nn.Module.__getattr__ stub (as in _vocab_parameters).
    true_size = model.get_input_embeddings().weight.shape[0]  # pyright: ignore[reportCallIssue]
    target = padded_size(true_size, multiple)
    if target == true_size:
        return true_size
    model.resize_token_embeddings(target, mean_resizing=False)  # pyright: ignore[reportCallIssue]
    with torch.no_grad():
        for param in _vocab_parameters(model):
            param[true_size:].zero_()
    return true_size


def vocab_parameter_names(model: nn.Module) -> list[str]:
    """State-dict names of the per-token parameters (tied weights: every name they appear under)."""
    ids = {id(p) for p in _vocab_parameters(model)}
    return [name for name, param in model.named_parameters(remove_duplicate=False) if id(param) in ids]


def cut_to_true_vocab(state_dict: dict[str, torch.Tensor], names: set[str], true_size: int) -> dict[str, torch.Tensor]:
    """`state_dict` with the per-token tensors among `names` cut to the true vocabulary."""
    return {
        name: tensor[:true_size] if name in names and tensor.shape[0] > true_size else tensor
        for name, tensor in state_dict.items()
    }


@contextlib.contextmanager
def true_vocab_config(model: nn.Module, true_size: int) -> Iterator[None]:
    """While writing a checkpoint, the model's config says the true vocabulary size."""
    # A transformers model's PretrainedConfig (torch's stubs type module attributes as Tensor | Module).
    model_config: Any = model.config
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    padded = config.vocab_size
    config.vocab_size = true_size
    try:
        yield
    finally:
        config.vocab_size = padded
