"""The segment runner's sharded pieces at W = 1 (one process, its own group): DCP state and the export from shards.

`save_sharded_training_state` then `load_training_state` into a trainer built
from another seed gives back the saved weights and revision, bitwise; the
export from the shards loads in transformers with those weights, and a fault
in any phase leaves no staging behind. The W = 2 path runs in
tests/e2e/flows/test_fsdp_pipeline.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from tests.conftest import tiny_tree
from trainer_core.config import config_from_dict
from trainer_core.model import build_trainer
from trainer_core.parallel.fsdp.checkpoint_io import restore_sharded_checkpoint
from trainer_core.ranks.topology import Topology
from trainer_core.run.distributed import training_mesh
from trainer_core.run.export_prepare import ExportPreparationError, prepare_export
from trainer_core.run.state import has_state, load_training_state, save_sharded_training_state
from trainer_core.training.lora_injection import inject_lora

TOPOLOGY = Topology(rank=0, world_size=1, logical_dp=2)


@pytest.fixture
def mesh():
    assert not dist.is_initialized()
    yield training_mesh(TOPOLOGY)
    dist.destroy_process_group()


def _trainer(tmp_path: Path, mesh, seed: int):
    config = config_from_dict(
        tiny_tree(tmp_path, run={"seed": seed}, train={"sharding": "fsdp", "reduction": "fast", "nproc_per_node": 1}),
        config_dir=tmp_path,
    )
    return config, build_trainer(config, mesh=mesh)


def _full(trainer) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in trainer.model.named_parameters()
    }


def test_a_sharded_state_restores_bitwise_into_a_trainer_built_otherwise(tmp_path, mesh):
    _, saved = _trainer(tmp_path, mesh, seed=1)
    assert all(isinstance(p, DTensor) for p in saved.model.parameters())
    state_dir = tmp_path / "state" / "segment-0000"
    size = save_sharded_training_state(state_dir, saved.checkpoints, {"next_step": 3}, rank=0)
    assert has_state(state_dir) and size > 0 and not state_dir.with_name("segment-0000.tmp").exists()
    assert any(state_dir.rglob("*.distcp"))
    _, restored = _trainer(tmp_path, mesh, seed=2)
    before = _full(restored)
    assert any(not torch.equal(before[n], t) for n, t in _full(saved).items())  # the seeds built other weights
    assert load_training_state(state_dir, restored.checkpoints) == {"next_step": 3}
    for name, tensor in _full(saved).items():
        assert torch.equal(_full(restored)[name], tensor), name


def test_a_sharded_state_into_an_unsharded_bf16_checkpoint_takes_the_weights_and_refuses_the_moments(tmp_path, mesh):
    _, saved = _trainer(tmp_path, mesh, seed=1)
    state_dir = tmp_path / "state" / "segment-0000"
    save_sharded_training_state(state_dir, saved.checkpoints, {"next_step": 3}, rank=0)
    tree = tiny_tree(tmp_path / "bf16", run={"seed": 2}, train={"dtype": "bfloat16", "nproc_per_node": 1})
    (replica,) = build_trainer(config_from_dict(tree, config_dir=tmp_path)).checkpoints.values()
    assert replica.master_weights()
    with pytest.raises(ValueError, match="FP32 master weights .* with_optimizer=False"):
        restore_sharded_checkpoint(replica, state_dir / "base")
    restore_sharded_checkpoint(replica, state_dir / "base", with_optimizer=False)
    weights = _full(saved)
    for name, param in replica.parameters().items():
        assert torch.equal(param, weights[name].to(torch.bfloat16)), name


def test_an_adapter_injected_after_sharding_is_refused_and_the_model_left_as_it_was(tmp_path, mesh):
    from peft import LoraConfig

    _, trainer = _trainer(tmp_path, mesh, seed=1)
    before = [name for name, _ in trainer.model.named_parameters()]
    with pytest.raises(ValueError, match="already sharded: inject every adapter before shard_model"):
        inject_lora(trainer.model, "late", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    assert [name for name, _ in trainer.model.named_parameters()] == before
    assert not hasattr(trainer.model, "peft_config")


def test_a_state_directory_that_is_a_symlink_is_replaced_never_written_through(tmp_path, mesh):
    _, trainer = _trainer(tmp_path, mesh, seed=1)
    elsewhere, other_tmp = tmp_path / "elsewhere", tmp_path / "elsewhere-tmp"
    for target in (elsewhere, other_tmp):
        target.mkdir()
        (target / "keep.txt").write_text("not the run's")
    state_dir = tmp_path / "state" / "segment-0000"
    state_dir.parent.mkdir(parents=True)
    state_dir.symlink_to(elsewhere, target_is_directory=True)
    state_dir.with_name("segment-0000.tmp").symlink_to(other_tmp, target_is_directory=True)
    save_sharded_training_state(state_dir, trainer.checkpoints, {"next_step": 3}, rank=0)
    assert not state_dir.is_symlink() and has_state(state_dir)
    for target in (elsewhere, other_tmp):
        assert sorted(p.name for p in target.iterdir()) == ["keep.txt"]  # the links' targets untouched


def test_the_export_from_shards_loads_in_transformers_with_the_trainer_s_weights(tmp_path, mesh):
    config, trainer = _trainer(tmp_path, mesh, seed=1)
    out = tmp_path / "export"
    done = prepare_export(TOPOLOGY, config, trainer, out, {"run_id": "r", "step": 0})
    assert not done["reused"] and (out / "MANIFEST.json").is_file() and (out / "tokenizer.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype=torch.float32)
    weights = _full(trainer)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    again = prepare_export(TOPOLOGY, config, trainer, out, {"run_id": "r", "step": 0})
    assert again == {**done, "reused": True}  # the same shards: the staging is kept


@pytest.mark.parametrize("phase", ["weights", "write", "verify", "manifest"])
def test_a_fault_in_any_phase_aborts_and_leaves_no_staging(tmp_path, mesh, phase):
    config, trainer = _trainer(tmp_path, mesh, seed=1)
    out = tmp_path / "export"

    def fault(rank: int, at: str) -> None:
        if at == phase:
            raise OSError(f"injected at {at}")

    with pytest.raises(ExportPreparationError, match=f"failed on rank 0 .*OSError: injected at {phase}"):
        prepare_export(TOPOLOGY, config, trainer, out, {"run_id": "r", "step": 0}, fault)
    assert not out.exists() and not out.with_name("export.tmp").exists()


def test_a_sharded_state_whose_shards_another_machine_wrote_is_refused_not_put_in_place(tmp_path, mesh, monkeypatch):
    """Nodes with their own work dirs: a rank's shards land on its machine; rank 0 must not publish a partial state."""
    import trainer_core.run.state as state_module
    from trainer_core.parallel.fsdp.checkpoint_io import DCP_DIR, missing_shard_files

    _, saved = _trainer(tmp_path, mesh, seed=1)
    save = state_module.save_sharded_checkpoint

    def written_elsewhere(checkpoint, directory):
        save(checkpoint, directory)
        assert missing_shard_files(directory) == []  # whole where every rank wrote
        for shard in (directory / DCP_DIR).glob("*.distcp"):
            shard.unlink()  # as if its rank ran on another node, in that node's run directory

    monkeypatch.setattr(state_module, "save_sharded_checkpoint", written_elsewhere)
    state_dir = tmp_path / "state" / "segment-0000"
    with pytest.raises(ValueError, match=r"lacks the shards \['__0_0\.distcp'\].*must be one shared filesystem"):
        save_sharded_training_state(state_dir, saved.checkpoints, {"next_step": 3}, rank=0)
    assert not has_state(state_dir)
