"""`train.sharding = "fsdp"` through the whole pipeline: segments on shards, DCP state, export from the shards.

The reference is the same config with `train.sharding = "none"` at the same W
and the same (fast) reduction. Measured (CPU, gloo, W = 2, 6 steps, grad_clip
1.0): the first step's loss is bitwise the reference's, the gradient norms
agree to about 1e-6 relative (5.9612121582 vs 5.9612078667 at step 0: the
sharded norm sums each rank's shard squares, then all-reduces), and so the
exported weights are not bitwise equal: every tensor differs, by at most
2.1e-5 (the embedding) and about 1e-7 elsewhere. The test pins those bounds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.e2e.flows.test_pipeline import exported_weights, fetch_checkpoint, run_flow

pytestmark = [pytest.mark.flow, pytest.mark.distributed]

FAST = {"reduction": "fast", "threads_per_process": 1}


def test_a_sharded_run_commits_a_checkpoint_that_loads_in_transformers_equal_to_the_unsharded_run(tmp_path: Path):
    config, result = run_flow(tmp_path / "fsdp", train={**FAST, "sharding": "fsdp"})
    assert result["run_id"].startswith("test-")
    run_dir = Path(config.run.work_dir) / result["run_id"]
    state = run_dir / "state"
    assert any(state.rglob("*.distcp")), "the sharded run saved no DCP shards"
    sharded_dir = fetch_checkpoint(config, result, tmp_path / "fsdp-checkpoint")
    loaded = AutoModelForCausalLM.from_pretrained(str(sharded_dir), local_files_only=True, dtype=torch.float32)
    assert {n: p.shape for n, p in loaded.state_dict().items()}

    reference_config, reference = run_flow(tmp_path / "none", train=FAST)
    assert reference["run_id"] != result["run_id"]  # sharding is in the digest: another run
    reference_dir = fetch_checkpoint(reference_config, reference, tmp_path / "none-checkpoint")
    sharded, unsharded = exported_weights(sharded_dir), exported_weights(reference_dir)
    assert sharded.keys() == unsharded.keys()
    gaps = {name: (sharded[name] - unsharded[name]).abs().max().item() for name in sharded}
    assert max(gaps.values()) < 1e-4, f"sharded export far from the unsharded run's: {gaps}"
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, sharded[name]), name  # transformers loads exactly the files' weights

    first, reference_first = (
        _segment(run_dir, 0),
        _segment(Path(reference_config.run.work_dir) / reference["run_id"], 0),
    )
    assert first["losses"][0] == reference_first["losses"][0]  # same initial weights and data: bitwise
    for norm, reference_norm in zip(first["grad_norms"], reference_first["grad_norms"], strict=True):
        assert norm == pytest.approx(reference_norm, rel=1e-5)


def _segment(run_dir: Path, index: int) -> dict:
    return json.loads((run_dir / "segments" / f"segment-{index:04d}.json").read_text())
