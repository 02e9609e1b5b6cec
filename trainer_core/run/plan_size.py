"""Bound the plan by the memory and disk it needs, before it allocates any of it.

The plan lays out every optimizer step's rows in memory and writes them as
shards, so `train.steps × train.global_batch_size` rows of the row length
must fit. The row length is known once the data is tokenized (the longest
document, rounded up; `data.max_seq_len` when packing), so the bound comes from
the data and this machine, not from an arbitrary cap: past it, the user is told
how many steps fit and what to change.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import psutil

from trainer_core.config import RunConfig
from trainer_core.data import Prepared
from trainer_core.data.shards import round_up
from trainer_core.errors import ConfigError

# Bytes per token of each shard tensor (see trainer_core/data/shards.py).
_UNPACKED_BYTES = 8 + 1 + 1  # input_ids int64, loss_mask bool, attention_mask bool
_PACKED_BYTES = 8 + 4  # position_ids int64, document_ids int32
_RL_BYTES = 4 + 4 + 8  # advantages f32, behaviour_logprobs f32, policy_version int64
_ORDER_BYTES_PER_ROW = 16  # the unpacked step order: int64 indices, plus the permutations they are cut from


@dataclass(frozen=True)
class PlanSize:
    row_len: int
    bytes_per_row: int
    shard_bytes: int
    """All shards together: what the plan writes to disk."""
    peak_memory_bytes: int
    """Shards held at once, one segment being stacked, and the step order."""


def estimate_plan_size(config: RunConfig, prepared: Prepared) -> PlanSize:
    train, data = config.train, config.data
    longest = max(d.num_tokens for d in prepared.documents)
    row_len = round_up(data.max_seq_len if data.pack else longest)
    bytes_per_token = _UNPACKED_BYTES + (_PACKED_BYTES if data.pack else 0) + (_RL_BYTES if prepared.is_rl else 0)
    bytes_per_row = row_len * bytes_per_token
    rows = train.steps * train.global_batch_size
    segment_rows = min(train.steps_per_segment, train.steps) * train.global_batch_size
    shard_bytes = rows * bytes_per_row
    peak = shard_bytes + segment_rows * bytes_per_row + rows * _ORDER_BYTES_PER_ROW
    return PlanSize(row_len=row_len, bytes_per_row=bytes_per_row, shard_bytes=shard_bytes, peak_memory_bytes=peak)


def available_memory_bytes() -> int | None:
    """Memory this process can still get: MemAvailable (psutil), or less under a cgroup (v2) limit; None if unknown."""
    candidates = []
    try:
        candidates.append(psutil.virtual_memory().available)  # MemAvailable on Linux
    except (OSError, RuntimeError):
        pass
    # psutil reports the machine's memory; a container's cgroup limit is read by hand.
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            candidates.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    if not candidates and hasattr(os, "sysconf"):
        try:
            candidates.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError):
            pass
    return min(candidates) if candidates else None


def free_disk_bytes(directory: Path) -> int:
    """Free bytes on the filesystem `directory` would be created on."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return shutil.disk_usage(existing).free


def _gib(num_bytes: int) -> str:
    """Bytes in binary units, GiB and up (the sizes this module compares are large)."""
    value, unit = num_bytes / 2**30, "GiB"
    for bigger in ("TiB", "PiB", "EiB", "ZiB", "YiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"


def _steps_in_memory(config: RunConfig, size: PlanSize, memory_bytes: int) -> int:
    """The most steps whose plan fits in `memory_bytes` (the inverse of `estimate_plan_size`'s peak)."""
    train = config.train
    row = train.global_batch_size
    # Up to one segment, that segment is all the steps: it is held twice while stacked.
    within_one_segment = memory_bytes // (row * (2 * size.bytes_per_row + _ORDER_BYTES_PER_ROW))
    if within_one_segment < train.steps_per_segment:
        return max(0, within_one_segment)
    stacking = train.steps_per_segment * row * size.bytes_per_row
    return max(
        train.steps_per_segment, (memory_bytes - stacking) // (row * (size.bytes_per_row + _ORDER_BYTES_PER_ROW))
    )


def _advice(steps_that_fit: int, change: str) -> str:
    if steps_that_fit <= 0:
        return f"not even one step fits: {change.removeprefix('or ')}"
    return f"lower train.steps to at most {steps_that_fit}, {change}"


def check_plan_size(
    config: RunConfig, prepared: Prepared, *, memory_bytes: int | None = None, disk_bytes: int | None = None
) -> PlanSize:
    """Raise ConfigError when the plan would not fit in memory or on disk; `*_bytes` default to this machine's."""
    size = estimate_plan_size(config, prepared)
    train = config.train
    shape = (
        f"{train.steps} steps × {train.global_batch_size} rows × {size.row_len} tokens × "
        f"{size.bytes_per_row // size.row_len} bytes"
    )
    change = "or lower train.global_batch_size or data.max_seq_len" + (
        " (the row length when packing)" if config.data.pack else ""
    )
    memory_bytes = available_memory_bytes() if memory_bytes is None else memory_bytes
    if memory_bytes is not None and size.peak_memory_bytes > memory_bytes:
        raise ConfigError(
            f"train.steps={train.steps}: planning would hold about {_gib(size.peak_memory_bytes)} of shards in memory "
            f"({shape}), more than the {_gib(memory_bytes)} available; {_advice(_steps_in_memory(config, size, memory_bytes), change)}"
        )
    disk_bytes = free_disk_bytes(Path(config.run.work_dir)) if disk_bytes is None else disk_bytes
    if size.shard_bytes > disk_bytes:
        fit = disk_bytes // (train.global_batch_size * size.bytes_per_row)
        raise ConfigError(
            f"train.steps={train.steps}: the plan's shards would take about {_gib(size.shard_bytes)} ({shape}) but "
            f"run.work_dir={config.run.work_dir!r} has {_gib(disk_bytes)} free; {_advice(fit, change)}, or free space"
        )
    return size
