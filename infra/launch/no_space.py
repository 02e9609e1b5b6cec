"""Which disk ran out of space: the device and mount a path lives on, and what is free there now.

A full disk fails with ENOSPC (or EDQUOT) wherever a write happened to land,
often far from the cause; the report names the device and mount point, the
path that was written and the space left, so the fix (free space, or move
`run.work_dir`) is obvious. Read from /proc/self/mountinfo and statvfs; on a
system without them the path alone is named. `disk_is_full` tells a failure
that could not say why (a rank whose every write failed, its error record and
its log included) from one that could.
"""

from __future__ import annotations

import os
from pathlib import Path


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, source device, filesystem type) of every mount this process sees."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    mounts = []
    for line in lines:
        fields, _, rest = line.partition(" - ")
        parts, tail = fields.split(), rest.split()
        if len(parts) >= 5 and len(tail) >= 2:
            # mountinfo escapes spaces and the like as octal (\040).
            point = parts[4].encode().decode("unicode_escape")
            mounts.append((point, tail[1], tail[0]))
    return mounts


def mount_of(path: Path) -> tuple[str, str, str] | None:
    """The mount (point, device, type) holding `path`: the longest mount point that contains it."""
    target = os.path.realpath(path)
    inside = [m for m in _mounts() if target == m[0] or target.startswith(m[0].rstrip("/") + "/")]
    return max(inside, key=lambda m: len(m[0]), default=None)


FULL_BELOW_BYTES = 1 << 20
"""A disk with less than this free (to this user) counts as full: no stage's write fits in it."""


def disk_is_full(path: Path, below_bytes: int = FULL_BELOW_BYTES) -> bool:
    """Whether the disk holding `path` (or its nearest existing parent) has less than `below_bytes` free."""
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        stats = os.statvfs(existing)
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize < below_bytes


def _bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def describe_no_space(path: Path) -> str:
    """`no space on DEVICE/PATH (TYPE mounted at MOUNT, FREE of SIZE free)` for a write under `path`."""
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    mount = mount_of(existing)
    try:
        stats = os.statvfs(existing)
        space = f"{_bytes(stats.f_bavail * stats.f_frsize)} of {_bytes(stats.f_blocks * stats.f_frsize)} free"
    except OSError:
        space = "free space unknown"
    if mount is None:
        return f"no space on the disk of {path} ({space})"
    point, device, kind = mount
    return f"no space on {device}:{path} ({kind} mounted at {point}, {space})"
