"""A torch optimizer's `state_dict()` as named tensors and string metadata (a safetensors file), and back.

The AdamW moments are two thirds of a full fine-tune's state. Kept as named
tensors they are written by the same direct safetensors writer as the
weights (`trainer_core.safetensors_write`) and read back past the page
cache into memory of their own (`trainer_core.safetensors_read`), where
`torch.save`'s zip went through the page cache.

    state.<param index>.<key>   every tensor of the per-parameter state (exp_avg, exp_avg_sq, step)
    metadata "state_values"      the per-parameter entries that are not tensors, as JSON
    metadata "param_groups"      the parameter groups (lr, betas, eps, …, params) as JSON

JSON has no tuples: a list in a group is read back as a tuple (betas), except
"params", which torch keeps as a list.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch

TENSOR_PREFIX = "state."
FORMAT_KEY = "format"
FORMAT = "rankflow.optimizer.v1"


def optimizer_to_tensors(state_dict: Mapping) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(named tensors, metadata) holding `state_dict` (as `torch.optim.Optimizer.state_dict()` returns it)."""
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, dict[str, object]] = {}
    for index, entries in state_dict["state"].items():
        for key, value in entries.items():
            if "." in key:
                raise ValueError(f"optimizer state key {key!r} holds a '.', which the saved names use as separator")
            if isinstance(value, torch.Tensor):
                tensors[f"{TENSOR_PREFIX}{index}.{key}"] = value
            else:
                values.setdefault(str(index), {})[key] = value
    for group in state_dict["param_groups"]:
        if bad := [key for key, value in group.items() if isinstance(value, torch.Tensor)]:
            raise ValueError(f"optimizer group options {bad} are tensors; give them as Python numbers to save them")
    metadata = {
        FORMAT_KEY: FORMAT,
        "state_values": json.dumps(values, sort_keys=True),
        "param_groups": json.dumps(state_dict["param_groups"], sort_keys=True),
    }
    return tensors, metadata


def check_optimizer_metadata(metadata: Mapping[str, str]) -> None:
    """Refuse metadata that `optimizer_to_tensors` did not write."""
    if metadata.get(FORMAT_KEY) != FORMAT:
        raise ValueError(f"not a saved optimizer state (format {metadata.get(FORMAT_KEY)!r}, expected {FORMAT!r})")


def optimizer_from_tensors(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> dict:
    """The `state_dict` that `optimizer_to_tensors` took apart (the tensors as given, not copied)."""
    check_optimizer_metadata(metadata)
    state: dict[int, dict[str, object]] = {}
    for index, entries in json.loads(metadata["state_values"]).items():
        state.setdefault(int(index), {}).update(entries)
    for name, tensor in tensors.items():
        index, _, key = name.removeprefix(TENSOR_PREFIX).partition(".")
        if not name.startswith(TENSOR_PREFIX) or not index.isdigit() or not key:
            raise ValueError(f"the saved optimizer state holds a tensor {name!r}, not 'state.<index>.<key>'")
        state.setdefault(int(index), {})[key] = tensor
    groups = [
        {key: tuple(value) if isinstance(value, list) and key != "params" else value for key, value in group.items()}
        for group in json.loads(metadata["param_groups"])
    ]
    return {"state": dict(sorted(state.items())), "param_groups": groups}
