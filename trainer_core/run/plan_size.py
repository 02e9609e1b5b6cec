"""Bound the plan by the memory and disk it needs, before it allocates any of it.

The plan streams: it lays out one segment's rows at a time and writes them as
a shard before the next, while the documents stay on disk (a store, see
`trainer_core.data.store`) and only small per-conversation integers stay in
memory. So its memory is one segment's rows (held twice while stacked and
written), the step order (16 bytes a row of the run) and
`BYTES_PER_CONVERSATION`; its disk is every step's rows. The row length is
known once the data is tokenized (the longest document, rounded up;
`data.max_seq_len` when packing), so the bound comes from the data and this
machine, not from an arbitrary cap: past it, the user is told how many steps
fit and what to change.
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
from trainer_core.data.store import INDEX_BYTES_PER_DOCUMENT
from trainer_core.errors import ConfigError

_ORDER_BYTES_PER_ROW = 16  # the unpacked step order: int64 indices, plus the permutations they are cut from
BYTES_PER_CONVERSATION = INDEX_BYTES_PER_DOCUMENT + 8 + 16 + 8
"""The store's index (RL: and a policy version), the kept documents' indices and lengths, and one epoch's
permutation (int64 each): 72 bytes, so 10^7 conversations take about 0.7 GB whatever their length."""


@dataclass(frozen=True)
class PlanSize:
    row_len: int
    bytes_per_row: int
    shard_bytes: int
    """All shards together: what the plan writes to disk."""
    peak_memory_bytes: int
    """One segment's rows held twice (laid out and stacked, or stacked and serialized), the step order, and the
    per-conversation integers."""
    conversation_bytes: int = 0
    """The per-conversation part of the peak: what no choice of steps changes."""


def estimate_plan_size(config: RunConfig, prepared: Prepared) -> PlanSize:
    train, data = config.train, config.data
    longest = int(prepared.lengths.max())
    row_len = round_up(data.max_seq_len if data.pack else longest)
    bytes_per_token = prepared.kind.shard_bytes_per_token(packed=data.pack)
    bytes_per_row = row_len * bytes_per_token
    rows = train.steps * train.global_batch_size
    segment_rows = min(train.steps_per_segment, train.steps) * train.global_batch_size
    shard_bytes = rows * bytes_per_row
    conversation_bytes = prepared.num_records * BYTES_PER_CONVERSATION
    peak = conversation_bytes + 2 * segment_rows * bytes_per_row + rows * _ORDER_BYTES_PER_ROW
    return PlanSize(
        row_len=row_len,
        bytes_per_row=bytes_per_row,
        shard_bytes=shard_bytes,
        peak_memory_bytes=peak,
        conversation_bytes=conversation_bytes,
    )


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
    room = memory_bytes - size.conversation_bytes
    # Up to one segment, that segment is all the steps: its rows are held twice, and ordered.
    within_one_segment = room // (row * (2 * size.bytes_per_row + _ORDER_BYTES_PER_ROW))
    if within_one_segment < train.steps_per_segment:
        return max(0, within_one_segment)
    segment = 2 * train.steps_per_segment * row * size.bytes_per_row
    return max(train.steps_per_segment, (room - segment) // (row * _ORDER_BYTES_PER_ROW))


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

    def shape(steps: int) -> str:
        return (
            f"{steps} steps × {train.global_batch_size} rows × {size.row_len} tokens × "
            f"{size.bytes_per_row // size.row_len} bytes"
        )

    change = "or lower train.global_batch_size or data.max_seq_len" + (
        " (the row length when packing)" if config.data.pack else ""
    )
    memory_bytes = available_memory_bytes() if memory_bytes is None else memory_bytes
    if memory_bytes is not None and size.peak_memory_bytes > memory_bytes:
        raise ConfigError(
            f"train.steps={train.steps}: planning would hold about {_gib(size.peak_memory_bytes)} in memory "
            f"(a segment's shard of {shape(min(train.steps_per_segment, train.steps))}, twice, the run's step order "
            f"at {_ORDER_BYTES_PER_ROW} bytes a row, and {prepared.num_records} conversations' index), more than the {_gib(memory_bytes)} available; {_advice(_steps_in_memory(config, size, memory_bytes), change)}"
        )
    disk_bytes = free_disk_bytes(Path(config.run.work_dir)) if disk_bytes is None else disk_bytes
    if size.shard_bytes > disk_bytes:
        fit = disk_bytes // (train.global_batch_size * size.bytes_per_row)
        raise ConfigError(
            f"train.steps={train.steps}: the plan's shards would take about {_gib(size.shard_bytes)} ({shape(train.steps)}) but "
            f"run.work_dir={config.run.work_dir!r} has {_gib(disk_bytes)} free; {_advice(fit, change)}, or free space"
        )
    return size
