"""The parallelisms' `train.sharding` names, torch-free: the config offers them, the registry checks against them."""

from __future__ import annotations

PARALLELISM_NAMES: tuple[str, ...] = ("none", "fsdp", "hsdp")
"""Every parallelism by its `train.sharding` name (the registry's keys, in order; checked when it is built)."""
REPLICATED = "none"
"""The name of the parallelism that spreads nothing (every process holds the whole model)."""
