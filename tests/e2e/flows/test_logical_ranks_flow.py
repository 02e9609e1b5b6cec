"""The README's main job at train.logical_dp = 4 on 1, 2 and 4 processes commits bitwise the same weights."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from flows.cli import main
from infra.publication.checkpoints import download_checkpoint, latest_checkpoint
from infra.store import open_store
from tests.conftest import EXAMPLES

pytestmark = [pytest.mark.flow, pytest.mark.distributed]


def committed_weights_sha256(store_url: str, run_id: str, dest: Path) -> str:
    store = open_store(store_url)
    checkpoint = download_checkpoint(store, run_id, latest_checkpoint(store, run_id), dest)
    return hashlib.sha256((checkpoint / "model.safetensors").read_bytes()).hexdigest()


def test_the_main_job_commits_the_same_weights_at_one_two_and_four_processes(prefect_harness, tmp_path, capsys):
    runs = {}
    for world_size in (1, 2, 4):
        base = tmp_path / f"w{world_size}"  # a store and work dir each: the run id is the same at every W
        code = main(
            [
                "run",
                str(EXAMPLES / "tiny_sft.toml"),
                "--set",
                "train.logical_dp=4",
                "--set",
                f"train.nproc_per_node={world_size}",
                "--set",
                "train.steps=4",
                "--set",
                "train.warmup_steps=2",  # the example's 5 would outlast the run: refused
                "--set",
                "train.steps_per_segment=2",
                "--set",
                f"run.work_dir={base / 'work'}",
                "--set",
                f"storage.url={base / 'store'}",
            ]
        )
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert code == 0 and summary["status"] == "completed", summary
        runs[world_size] = (
            summary["run_id"],
            summary["losses"],
            committed_weights_sha256(str(base / "store"), summary["run_id"], base / "download"),
        )
    assert len(runs[1][1]) == 4
    assert runs[2] == runs[1] and runs[4] == runs[1], runs
