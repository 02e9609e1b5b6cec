"""`rankflow checkpoints runs --store URL`: every run a store holds, its LATEST, its checkpoints, its last ledger line.

The reference is what the test itself put in the store (local and SeaweedFS):
two runs committed through the real publication protocol, a ledger, an
orphan that is not a checkpoint, and a prefix that is not a run.
"""

from __future__ import annotations

import json

import pytest

from flows.cli import main
from infra.publication.commit import commit_checkpoint
from infra.store import open_store
from infra.store.objects import put_small
from tests.publication_helpers import random_files, stage

RUN_A, RUN_B, EMPTY = "sft-aaaaaaaaaaaa", "rl-bbbbbbbbbbbb", "store-cccccccccccc"


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store_url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store")
    request.getfixturevalue("s3_env")
    return request.getfixturevalue("s3_bucket_url")


def _fill(store_url, tmp_path) -> None:
    store = open_store(store_url)
    for step in (10, 20):
        commit_checkpoint(stage(tmp_path / RUN_A, step, random_files(1, 500), run_id=RUN_A), store, RUN_A)
    commit_checkpoint(stage(tmp_path / RUN_B, 5, random_files(1, 500), run_id=RUN_B), store, RUN_B)
    put_small(store, store.path(RUN_B, "checkpoints", "step-00000009", "model.safetensors"), b"died mid-commit")
    lines = [
        {"time": 1.0, "stage": "segment", "status": "completed", "segment": 0},
        {"time": 2.0, "stage": "flow", "status": "failed", "error": "x" * 20000},
    ]  # a long last line
    put_small(store, store.path(RUN_A, "ledger.jsonl"), "".join(json.dumps(line) + "\n" for line in lines).encode())
    put_small(store, store.path("not-a-run", "notes.txt"), b"someone else's file")


def test_runs_lists_every_run_with_its_latest_checkpoints_and_last_ledger_status(store_url, tmp_path, capsys):
    _fill(store_url, tmp_path)
    assert main(["checkpoints", "runs", "--store", store_url, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    runs = {run["run_id"]: run for run in listed["runs"]}
    assert sorted(runs) == sorted([RUN_A, RUN_B])
    assert (runs[RUN_A]["latest"], runs[RUN_A]["latest_step"], runs[RUN_A]["num_checkpoints"]) == (
        "step-00000020",
        20,
        2,
    )
    assert (runs[RUN_A]["last_stage"], runs[RUN_A]["last_status"]) == ("flow", "failed")
    assert (runs[RUN_B]["latest"], runs[RUN_B]["latest_step"], runs[RUN_B]["num_checkpoints"]) == (
        "step-00000005",
        5,
        1,
    )
    assert runs[RUN_B]["last_status"] is None  # no ledger stored

    assert main(["checkpoints", "runs", "--store", store_url]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    row_a = next(line for line in lines if line.startswith(RUN_A))
    assert "step-00000020" in row_a and "2 checkpoints" in row_a and "flow failed" in row_a
    assert not any("not-a-run" in line for line in lines)


def test_runs_of_a_store_with_no_run_says_so(store_url, capsys):
    assert main(["checkpoints", "runs", "--store", store_url]) == 0
    assert "no runs" in capsys.readouterr().out
