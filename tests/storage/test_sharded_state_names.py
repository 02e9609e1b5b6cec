"""A stored sharded state names its own files (DCP's `.metadata`): nothing it names is trusted.

The attack: a store writer rewrites the metadata of a sharded state so that a shard is read from
`../../../../../outside/…`, and the bundle manifest's sha256 to match, so the state fetches and verifies. A file
of the right length and format is planted there (another trainer's shard: weights of its own). Today's DCP read
would load it into the weights; the restore must refuse the state, naming the file, with the weights as they were.
The metadata itself is a pickle: one that names any callable is refused without running it.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.tensor import DTensor

from infra.runs.run_state import fetch_bundle, publish_bundle
from infra.store import open_store
from tests.conftest import tiny_tree
from trainer_core.config import config_from_dict
from trainer_core.model import build_trainer
from trainer_core.parallel.fsdp.checkpoint_io import missing_shard_files
from trainer_core.ranks.topology import Topology
from trainer_core.run.distributed import training_mesh
from trainer_core.run.state import load_training_state, save_sharded_training_state
from trainer_core.training.dcp_checked_read import checked_metadata

RUN = "hostile-state"
STATE = "state/segment-0000"
SHARD = "__0_0.distcp"


@pytest.fixture
def mesh():
    assert not dist.is_initialized()
    yield training_mesh(Topology(rank=0, world_size=1, logical_dp=2))
    dist.destroy_process_group()


def _trainer(tmp_path: Path, mesh, seed: int):
    tree = tiny_tree(tmp_path, run={"seed": seed}, train={"sharding": "fsdp", "reduction": "fast", "nproc_per_node": 1})
    return build_trainer(config_from_dict(tree, config_dir=tmp_path), mesh=mesh)


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in trainer.model.named_parameters()
    }


def _rename_shards(metadata_file: Path, name: str) -> None:
    """Rewrite a `.metadata` so that every item DCP reads from SHARD is read from `name` instead."""
    metadata = pickle.loads(metadata_file.read_bytes())  # the test's own file: plain pickle is fine here
    for info in metadata.storage_data.values():
        if info.relative_path == SHARD:
            info.relative_path = name
    metadata_file.write_bytes(pickle.dumps(metadata))


def test_a_stored_state_whose_metadata_names_a_file_outside_is_refused_and_nothing_is_loaded(tmp_path, mesh):
    worker = tmp_path / "worker" / RUN
    saved = _trainer(tmp_path, mesh, seed=1)
    save_sharded_training_state(worker / STATE, saved.checkpoints, {"next_step": 3}, rank=0)
    planted = _trainer(tmp_path, mesh, seed=3)  # the planted shard: a real one, of the right length, other weights
    save_sharded_training_state(tmp_path / "planted" / STATE, planted.checkpoints, {"next_step": 3}, rank=0)

    # The fetching machine's run directory is tmp/fresh/RUN: five levels up from its dcp/ is tmp/fresh.
    outside = tmp_path / "fresh" / "outside" / SHARD
    outside.parent.mkdir(parents=True)
    shutil.copyfile(tmp_path / "planted" / STATE / "base" / "dcp" / SHARD, outside)
    _rename_shards(worker / STATE / "base" / "dcp" / ".metadata", f"../../../../../outside/{SHARD}")
    store = open_store(f"file://{tmp_path / 'store'}")
    paths = [p.relative_to(worker).as_posix() for p in sorted((worker / STATE).rglob("*")) if p.is_file()]
    publish_bundle(store, RUN, worker, "segment-0000", paths)  # the manifest's sha256 matches the hostile metadata

    fresh = tmp_path / "fresh" / RUN
    fetch_bundle(store, RUN, fresh, "segment-0000")  # it verifies: the digests are the writer's
    restored = _trainer(tmp_path, mesh, seed=2)
    before = _weights(restored)
    assert any(not torch.equal(before[name], tensor) for name, tensor in _weights(planted).items())
    with pytest.raises(ValueError, match=r"names the shard file '\.\./\.\./\.\./\.\./\.\./outside/__0_0\.distcp'"):
        load_training_state(fresh / STATE, restored.checkpoints)
    after = _weights(restored)
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())  # nothing of it was loaded


def _metadata(dcp_dir: Path, name: str, length: int = 4) -> Path:
    """A `dcp/` whose metadata places one item at `name` (and a real shard file beside it)."""
    dcp_dir.mkdir(parents=True)
    (dcp_dir / SHARD).write_bytes(b"\0" * 64)
    info = _StorageInfo(relative_path=name, offset=0, length=length)
    metadata = Metadata(state_dict_metadata={}, storage_data={MetadataIndex("params.w"): info})
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    return dcp_dir


@pytest.mark.parametrize(
    ("name", "refusal"),
    [
        ("../outside", "no plain file name"),
        ("/etc/hostname", "no plain file name"),
        ("sub/__0_0.distcp", "no plain file name"),
        ("..", "no plain file name"),
        ("", "no plain file name"),
        (".metadata", "no plain file name"),
        ("link.distcp", "no regular file \\(a link is refused\\)"),
    ],
)
def test_every_shard_name_is_a_plain_file_of_the_state(tmp_path, name, refusal):
    outside = tmp_path / "outside"
    outside.write_bytes(b"\0" * 64)
    dcp_dir = _metadata(tmp_path / "state" / "base" / "dcp", name)
    (dcp_dir / "link.distcp").symlink_to(outside)
    with pytest.raises(ValueError, match=refusal):
        checked_metadata(dcp_dir)
    if name != "link.distcp":  # the save's own check (a link there is simply missing)
        with pytest.raises(ValueError, match=refusal):
            missing_shard_files(dcp_dir.parent)
    else:
        assert missing_shard_files(dcp_dir.parent) == ["link.distcp"]
    assert checked_metadata(_metadata(tmp_path / "good" / "dcp", SHARD)).storage_data  # a plain name is read


def test_an_item_past_its_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="holds 64 bytes, not the 65"):
        checked_metadata(_metadata(tmp_path / "dcp", SHARD, length=65))


class _Runs:
    """A pickle that, unpickled, makes a directory: any callable a hostile metadata names would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return os.mkdir, (str(self.marker),)


def test_a_metadata_pickle_that_names_a_callable_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    dcp_dir = tmp_path / "dcp"
    dcp_dir.mkdir()
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(_Runs(marker)))
    for read in (checked_metadata, lambda directory: missing_shard_files(directory.parent)):
        with pytest.raises(ValueError, match=r"does not read .*names posix\.mkdir, which is no part of a DCP metadata"):
            read(dcp_dir)
        assert not marker.exists()
