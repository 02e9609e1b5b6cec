"""A plan's shards, written one segment at a time before the run id is known, then put in the run directory.

The plan digest covers every shard's bytes, and each shard file carries the run
id (the digest's first 12 hex digits) in its safetensors metadata, so a shard
cannot be written in its final form until all of them are laid out. Holding
them all in memory does not scale; laying them out twice would double the
plan's work. So each shard is written as soon as it is laid out, under
`run.work_dir/cache/plan-staging/`, with a placeholder run id of the same
length (`NAME-000000000000`); once the digest is known, `stamp` overwrites
those 12 bytes of each file's header in place. A safetensors header is JSON
whose length and layout do not depend on a string value of the same length,
so each file is then byte for byte what `save_file(..., metadata={"run_id":
run_id})` writes (tests/unit/test_plan_streams.py checks it).

`place` puts a staged shard into the run directory by hard link (a copy
across filesystems); the staging directory goes when the object is dropped.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

RUN_ID_HASH_DIGITS = 12
"""The run id is `NAME-` and this many hex digits of the plan digest."""


def staging_root(work_dir: str | Path) -> Path:
    return Path(work_dir) / "cache" / "plan-staging"


class StagedShards(Mapping[int, dict[str, torch.Tensor]]):
    """Segment index → that segment's shard, read from its staged file on access."""

    def __init__(self, root: Path, run_name: str) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.directory = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root))
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.directory), ignore_errors=True)
        self._run_name = run_name
        self._run_id = f"{run_name}-{'0' * RUN_ID_HASH_DIGITS}"
        self._indices: list[int] = []
        self._eval = False

    def path(self, index: int) -> Path:
        return self.directory / f"segment-{index:04d}.safetensors"

    @property
    def eval_path(self) -> Path:
        return self.directory / "eval.safetensors"

    def add(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, str(self.path(index)), metadata={"run_id": self._run_id})
        self._indices.append(index)

    def add_eval(self, tensors: dict[str, torch.Tensor]) -> None:
        """The held-out rows (`held_out.eval_shard`), staged and stamped like a segment's shard."""
        save_file(tensors, str(self.eval_path), metadata={"run_id": self._run_id})
        self._eval = True

    def stamp(self, run_id: str) -> None:
        """Write `run_id` into every staged file's metadata, in place of the one it has."""
        if len(run_id) != len(self._run_id) or not run_id.startswith(f"{self._run_name}-"):
            raise ValueError(f"run id {run_id!r} does not fit the placeholder {self._run_id!r}")
        old, new = f'"{self._run_id}"'.encode(), f'"{run_id}"'.encode()
        for path in [self.path(index) for index in self._indices] + ([self.eval_path] if self._eval else []):
            with open(path, "r+b") as handle:
                (header_len,) = struct.unpack("<Q", handle.read(8))
                header = handle.read(header_len)
                at = header.find(old)
                # The name is [A-Za-z0-9._-] and the tensor names are fixed: the quoted id occurs once.
                assert at >= 0 and header.find(old, at + 1) < 0, "the staged header holds the run id once"
                handle.seek(8 + at)
                handle.write(new)
        self._run_id = run_id

    def place(self, index: int | None, target: Path) -> None:
        """Put segment `index`'s staged file (None: the eval shard) at `target` (a hard link, or a copy across
        filesystems)."""
        source = self.eval_path if index is None else self.path(index)
        target.unlink(missing_ok=True)
        try:
            os.link(source, target)
        except OSError:
            shutil.copyfile(source, target)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index not in self._indices:
            raise KeyError(index)
        return load_file(str(self.path(index)))

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices)

    def __len__(self) -> int:
        return len(self._indices)
