"""Shared pieces of the storage benchmarks: a local SeaweedFS, a staged checkpoint, medians.

The checkpoint imitates an export: a few safetensors-sized shards of random
bytes (incompressible, like weights), an index, a config and a tokenizer,
with its MANIFEST.json, staged on local disk.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path

from infra.services.s3_server import CONFLICTING_AWS_ENV_VARS, S3Server, start_s3_server
from trainer_core.run.manifest import checkpoint_name, write_manifest

BUCKET = "bench"


@contextlib.contextmanager
def seaweedfs() -> Iterator[tuple[S3Server, Path]]:
    """A fresh server in a temporary directory, with os.environ pointing at it."""
    with tempfile.TemporaryDirectory(prefix="rankflow-bench-") as tmp:
        with start_s3_server(Path(tmp) / "s3") as server:
            server.create_bucket(BUCKET)
            for name in CONFLICTING_AWS_ENV_VARS:
                os.environ.pop(name, None)
            os.environ.update(server.env())
            yield server, Path(tmp)


def stage_checkpoint(directory: Path, run_id: str, step: int, num_shards: int, shard_bytes: int) -> Path:
    staged = directory / checkpoint_name(step)
    staged.mkdir(parents=True)
    for index in range(num_shards):
        name = f"model-{index + 1:05d}-of-{num_shards:05d}.safetensors"
        with open(staged / name, "wb") as handle:
            for _ in range(shard_bytes // 2**20):
                handle.write(os.urandom(2**20))
            handle.write(os.urandom(shard_bytes % 2**20))
    (staged / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": {}}')
    (staged / "config.json").write_text('{"model_type": "qwen3"}')
    (staged / "tokenizer.json").write_bytes(os.urandom(2_000_000))
    write_manifest(
        staged, {"run_id": run_id, "step": step, "plan_digest": "0" * 64, "parent_checkpoint": None, "world_size": 1}
    )
    return staged


def staged_bytes(staged: Path) -> int:
    return sum(p.stat().st_size for p in staged.rglob("*") if p.is_file())


def median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def checkpoint_arguments(description: str) -> argparse.ArgumentParser:
    """The options both storage benchmarks take: repetitions and the checkpoint's shape."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--shard-mb", type=int, default=50)
    return parser
