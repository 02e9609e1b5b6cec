"""A local store's tree: symbolic links, leftovers of interrupted writes, and folders emptied by a removal.

Functions of a store's root directory and full paths under it (no store
object), used by LocalStore (local.py) and the collection of a run's objects
(infra/store/objects.py, infra/publication/orphans.py). Nothing is ever removed through a
symbolic link that leads out of the root.
"""

from __future__ import annotations

import os
from pathlib import Path

import fsspec

from .base import find_files
from .durable import TEMP_MARKER


def list_links(fs: fsspec.AbstractFileSystem, base: str) -> dict[str, str]:
    """The symbolic links under the full path `base/` (relative path → target)."""
    prefix = base.rstrip("/") + "/"
    try:
        found = fs.find(prefix, detail=True)
    except FileNotFoundError:
        return {}
    # fsspec's find(detail=True) returns a dict (its inferred type is dict | list).
    return {
        path.removeprefix(prefix): os.readlink(path)
        for path, info in found.items()  # pyright: ignore[reportAttributeAccessIssue]
        if path.startswith(prefix) and info.get("islink")
    }


def outside_root(root: str, path: str) -> str | None:
    """Where `path` really is when a symbolic link takes it out of `root`, else None."""
    root, real = os.path.realpath(root), os.path.realpath(path)
    return None if real == root or real.startswith(root.rstrip(os.sep) + os.sep) else real


def refuse_outside(root: str, path: str, directory: str) -> None:
    """Raise PermissionError when removing `path` (in `directory`) would reach out of `root` through a link."""
    escaped = outside_root(root, directory)
    if escaped is not None:
        raise PermissionError(
            f"refusing to remove {path}: through a symbolic link it lies in {escaped}, outside the "
            f"store {root}; nothing is removed outside a store — remove the link by hand"
        )


def remove_paths(root: str, paths: list[str]) -> None:
    """Unlink full `paths` (missing is fine), all checked against links out of `root` before any is removed."""
    for path in paths:
        refuse_outside(root, path, os.path.dirname(path))
    for path in paths:
        Path(path).unlink(missing_ok=True)


def remove_left_temporaries(
    fs: fsspec.AbstractFileSystem, root: str, prefix: str, *, skip: tuple[str, ...] = ()
) -> list[str]:
    """Remove the temporary files interrupted writes left under the full path `prefix/`, but this process's own
    and those under the folders in `skip`; the paths removed."""
    own = f"{TEMP_MARKER}{os.getpid()}-"
    resolved_root = Path(root).resolve()
    removed = []
    for path in sorted(find_files(fs, prefix)):
        name = path.rsplit("/", 1)[-1]
        if TEMP_MARKER not in name or own in name or path.startswith(tuple(f"{folder}/" for folder in skip)):
            continue
        target = Path(prefix, path)
        # Never through a link: a linked folder inside the store could point anywhere.
        if target.parent.resolve() != resolved_root / target.parent.relative_to(root):
            continue
        target.unlink(missing_ok=True)
        removed.append(f"{prefix.rstrip('/')}/{path}")
    return removed


def remove_empty_directories(root: str, base: str, deepest_first: list[str]) -> None:
    """rmdir each of `deepest_first` that is empty; never through a link out of `root`."""
    refuse_outside(root, base, base)
    for directory in deepest_first:
        try:
            os.rmdir(directory)  # only when empty; never a link (ENOTDIR)
        except OSError:
            continue
