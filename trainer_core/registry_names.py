"""The names each registry offers the config, torch-free, and the check that ties them to their registry.

The config is loaded by every command, bad input included, and that path must
not import torch or a tracking library (seconds per process); the registries'
classes do. So each registry's names live here as plain data that the config
validates against, and each registry calls `check_names` at its own import: a
name registered but not listed here (or listed but not registered) fails at
that import, never silently in the config's choices. Adding to a registry is
its file, its registry line and its name here.

| names | config field | registry (checked at its import) |
|---|---|---|
| `BACKWARD_MODES` (+ `PLANNER`) | `train.backward_mode` | `trainer_core.training.memory.BACKWARD_STATES` |
| `OBJECTIVE_NEEDS` | `train.objective` | `trainer_core.objectives.OBJECTIVES` (each class's `needs`) |
| `TRACKING_BACKENDS` (+ `NO_TRACKING`) | `tracking.backend` | `infra.tracking.BACKENDS` |
| `STORE_SCHEMES` | the scheme of `storage.url` (trainer_core/storage_url.py) | `infra.store.BACKENDS` |
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

BACKWARD_MODES: tuple[str, ...] = ("retain", "offload", "replay")
"""Every backward mode by name, in the order the planner considers them (the registry's keys, in order)."""
PLANNER = "auto"
"""The config's name for "let the planner choose the mode of each forward"."""

OBJECTIVE_NEEDS: dict[str, tuple[str, ...]] = {
    "sft": ("loss_mask",),
    "clipped_policy_gradient": ("loss_mask", "behaviour_logprobs", "advantages", "policy_version"),
}
"""Every objective by name, with the shard tensors it reads: the config refuses data that do not carry them."""

TRACKING_BACKENDS: tuple[str, ...] = ("mlflow", "tensorboard", "wandb")
"""Every experiment-tracking backend by name."""
NO_TRACKING = "none"
"""The config's name for "track nothing"."""

STORE_SCHEMES: tuple[str, ...] = ("file", "s3")
"""Every `storage.url` scheme by name (a URL with no scheme is a local path, as `file://` is)."""


def check_names(field: str, names: Iterable[str] | Mapping[str, object], registered: Mapping[str, object]) -> None:
    """Refuse, at the registry's import, a registry whose entries are not `names` (keys and order; values too).

    `field` is the config field the names are the choices of (for the message).
    """
    listed = dict(names) if isinstance(names, Mapping) else dict.fromkeys(names)
    found = dict(registered) if isinstance(names, Mapping) else dict.fromkeys(registered)
    if list(listed.items()) != list(found.items()):
        raise ImportError(
            f"the registry of {field} holds {found}, and trainer_core.registry_names lists {listed} for the config; "
            "make them the same (a registry entry and its name there are added together)"
        )
