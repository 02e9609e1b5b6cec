"""`[model.lora]` with `train.sharding = "fsdp"` through the whole pipeline: an adapter over a sharded frozen base.

The config is examples/tiny_lora.toml's adapter (rank 16 on every projection,
dropout 0.05, merged export) on the test's tiny run, two segments of one step
(so the second resumes from the first one's DCP state), W = 2, the
deterministic reduction with clipping at every step (`grad_clip = 0.05`).
The reference is the same config with `train.sharding = "none"`: the
sharded ordered fold and both reductions' `canonical_norm` make every step
the unsharded run's bit for bit, clipped included, and the test pins that:
the committed adapter, base and merged weights are bitwise the unsharded
run's, and peft loads the adapter over the shipped base.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from torch.distributed.checkpoint.filesystem import FileSystemReader
from transformers import AutoModelForCausalLM

from tests.e2e.flows.test_pipeline import exported_weights, fetch_checkpoint, run_flow

pytestmark = [pytest.mark.flow, pytest.mark.distributed]

LORA = {
    "rank": 16,
    "alpha": 32.0,
    "dropout": 0.05,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
TRAIN = {"reduction": "deterministic", "steps": 2, "steps_per_segment": 1, "grad_clip": 0.05}
ADAPTER = "adapter_model.safetensors"


def _run(tmp_path: Path, sharding: str):
    config, result = run_flow(
        tmp_path, model={"lora": LORA}, export={"merge_lora": True}, train={**TRAIN, "sharding": sharding}
    )
    return config, result, fetch_checkpoint(config, result, tmp_path / "checkpoint")


def _adapter_config(checkpoint_dir: Path) -> dict:
    """adapter_config.json with target_modules as a set: peft keeps them in one, whose order varies per process."""
    config = json.loads((checkpoint_dir / "adapter_config.json").read_text())
    return {**config, "target_modules": set(config["target_modules"])}


def test_a_sharded_lora_run_commits_the_unsharded_runs_adapter_bit_for_bit(tmp_path: Path):
    config, result, sharded_dir = _run(tmp_path / "fsdp", "fsdp")
    run_dir = Path(config.run.work_dir) / result["run_id"]
    # The segment state holds the adapter and its AdamW state only: the frozen base is rebuilt from the config.
    states = sorted((run_dir / "state").glob("*/lora/dcp"))
    assert states, "the sharded LoRA run saved no DCP state"
    saved = FileSystemReader(str(states[0])).read_metadata().state_dict_metadata
    params = [key for key in saved if key.startswith("params.")]
    assert params and all("lora_" in key for key in params), params
    assert all("lora_" in key for key in saved if key.startswith("optimizer.state.")), sorted(saved)

    reference_config, reference, reference_dir = _run(tmp_path / "none", "none")
    files = sorted(p.relative_to(sharded_dir).as_posix() for p in sharded_dir.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(reference_dir).as_posix() for p in reference_dir.rglob("*") if p.is_file())
    assert "base/model.safetensors" in files and "merged/model.safetensors" in files, files
    adapter, reference_adapter = load_file(str(sharded_dir / ADAPTER)), load_file(str(reference_dir / ADAPTER))
    assert adapter.keys() == reference_adapter.keys()
    assert all(torch.equal(adapter[k], reference_adapter[k]) for k in adapter), (
        "adapter differs from the unsharded run's"
    )
    assert _adapter_config(sharded_dir) == _adapter_config(reference_dir)
    for part in ("base", "merged"):
        ours, theirs = exported_weights(sharded_dir / part), exported_weights(reference_dir / part)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), part

    base = AutoModelForCausalLM.from_pretrained(str(sharded_dir / "base"), local_files_only=True, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(sharded_dir)).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(sharded_dir / "merged"), local_files_only=True).eval()
    ids = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        adapted, merged_logits = loaded(input_ids=ids).logits, merged(input_ids=ids).logits
    assert (adapted - merged_logits).abs().max() < 1e-4  # peft's merge of the same adapter: rounding apart
    with loaded.disable_adapter(), torch.no_grad():
        untrained = loaded(input_ids=ids).logits
    assert (adapted - untrained).abs().max() > 1e-3  # the adapter trained: a base alone would not pass

    reference_run = Path(reference_config.run.work_dir) / reference["run_id"]
    for segment in ("segment-0000.json", "segment-0001.json"):  # the second resumed from the DCP state
        ours, theirs = (json.loads((d / "segments" / segment).read_text()) for d in (run_dir, reference_run))
        assert ours["losses"] == theirs["losses"], segment  # same adapter init, dropout and data: bitwise
        assert ours["grad_norms"] == theirs["grad_norms"], segment
        assert all(norm > 2 * TRAIN["grad_clip"] for norm in ours["grad_norms"]), segment  # clipping bites
