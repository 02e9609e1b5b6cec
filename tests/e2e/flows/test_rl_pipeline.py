"""The pipeline on RL trajectories, packed: clipped policy gradient, stale data dropped and counted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from infra.runs import ledger
from tests.conftest import EXAMPLES
from tests.e2e.flows.test_pipeline import fetch_checkpoint, run_flow
from trainer_core.run.plan import load_segment_shard, read_plan
from trainer_core.run.progress import ProgressReader, progress_path

pytestmark = [pytest.mark.flow, pytest.mark.distributed]


def test_packed_rl_run_commits_and_counts_stale_trajectories(prefect_harness, tmp_path):
    config, result = run_flow(
        tmp_path,
        data={"path": str(EXAMPLES / "tiny" / "rl.jsonl"), "kind": "rl", "pack": True},
        # The weights start as policy version 3; from step 1 on, version-0 data is over the bound.
        rl={"initial_policy_version": 3, "max_data_staleness": 3, "sft_coef": 0.1},
        train={"backward_mode": "replay"},
    )
    assert result["status"] == "completed" and len(result["losses"]) == 6
    assert all(torch.isfinite(torch.tensor(result["losses"])))
    run_dir = Path(config.run.work_dir) / result["run_id"]
    plan = read_plan(run_dir)
    assert plan.data_kind == "rl" and plan.packed
    shard = load_segment_shard(run_dir, plan.segments[0])
    assert {"advantages", "behaviour_logprobs", "policy_version", "position_ids", "document_ids"} <= set(shard)
    assert int(shard["document_ids"].max()) > 1  # rows really hold several trajectories
    segments = [e for e in ledger.read(run_dir) if e["stage"] == "segment" and e["status"] == "completed"]
    assert sum(e["num_stale_trajectories"] for e in segments) > 0
    # The live records carry the RL figures of every step, summed over ranks like the segment's totals.
    steps = [
        r for i in range(2) for r in ProgressReader(progress_path(run_dir, i)).new_records() if r["event"] == "step"
    ]
    assert [r["step"] for r in steps] == list(range(6))
    assert sum(r["stale_trajectories_dropped"] for r in steps) == sum(e["num_stale_trajectories"] for e in segments)
    kept = [r for r in steps if r["clip_fraction"] is not None]  # a step whose data were all stale keeps none
    assert kept and all(0 <= r["clip_fraction"] <= 1 and r["mean_importance_ratio"] > 0 for r in kept)
    checkpoint = fetch_checkpoint(config, result, tmp_path / "download")
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), local_files_only=True)
    assert model.config.vocab_size == 1024
