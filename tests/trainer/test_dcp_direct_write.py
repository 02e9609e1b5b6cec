"""DCP's writer with its files written straight to the disk: the stock writer's bytes, past the page cache, read
back by DCP; a stream that fails leaves its error, not a hang or a descriptor."""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tests.page_cache import resident_pages
from trainer_core import direct_write
from trainer_core.parallel.fsdp.dcp_direct_write import DirectStream, direct_writer


def state() -> dict:
    generator = torch.Generator().manual_seed(2)
    return {
        "params": {"w": torch.randn(700, 1031, generator=generator), "b": torch.randn(5, generator=generator).half()},
        "optimizer": {
            "state": {"w": {"step": torch.tensor(4.0), "exp_avg": torch.randn(700, 1031, generator=generator)}}
        },
        "note": "kept as bytes",
    }


def test_the_rank_file_is_the_stock_writers_bytes_and_reads_back(tmp_path):
    saved = state()
    dcp_save(saved, checkpoint_id=str(tmp_path / "stock"))
    dcp_save(saved, storage_writer=direct_writer(tmp_path / "direct"))
    stock = {p.name: p.read_bytes() for p in (tmp_path / "stock").iterdir() if p.suffix == ".distcp"}
    direct = {p.name: p.read_bytes() for p in (tmp_path / "direct").iterdir() if p.suffix == ".distcp"}
    assert stock and direct == stock
    assert FileSystemReader(str(tmp_path / "direct")).read_metadata().state_dict_metadata.keys() == (
        FileSystemReader(str(tmp_path / "stock")).read_metadata().state_dict_metadata.keys()
    )
    loaded = {
        "params": {k: torch.zeros_like(v) for k, v in saved["params"].items()},
        "optimizer": {"state": {"w": {"step": torch.tensor(0.0), "exp_avg": torch.zeros(700, 1031)}}},
        "note": "",
    }
    dcp_load(loaded, checkpoint_id=str(tmp_path / "direct"))
    assert torch.equal(loaded["params"]["w"], saved["params"]["w"]) and torch.equal(
        loaded["params"]["b"], saved["params"]["b"]
    )
    assert torch.equal(loaded["optimizer"]["state"]["w"]["exp_avg"], saved["optimizer"]["state"]["w"]["exp_avg"])
    assert loaded["note"] == "kept as bytes"


def test_the_rank_file_goes_past_the_page_cache(tmp_path):
    with direct_write.DirectFile(tmp_path / "probe") as probe:
        if not probe.direct:
            pytest.skip(
                "this filesystem refuses O_DIRECT: the stock cached path is taken (tested in test_safetensors_write)"
            )
    dcp_save(state(), storage_writer=direct_writer(tmp_path / "direct"))
    (rank_file,) = (tmp_path / "direct").glob("*.distcp")
    assert resident_pages(rank_file) <= 2


def test_the_descriptor_is_handed_out_once_every_byte_is_written_and_nothing_may_follow(tmp_path):
    stream = DirectStream(tmp_path / "f")
    stream.write(b"x" * 5000)
    descriptor = stream.fileno()
    os.fsync(descriptor)
    assert (tmp_path / "f").read_bytes() == b"x" * 5000  # written and cut to length before the fsync
    with pytest.raises(ValueError, match="written after it was finished"):
        stream.write(b"y")
    stream.close()
    stream.close()
    assert (tmp_path / "f").read_bytes() == b"x" * 5000


def test_a_failing_write_raises_out_of_the_save(tmp_path, monkeypatch):
    def full_disk(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(direct_write.os, "pwrite", full_disk)
    descriptors = len(os.listdir("/proc/self/fd"))
    with pytest.raises(CheckpointException) as raised:
        dcp_save(state(), storage_writer=direct_writer(tmp_path / "direct"))
    ((error, _frames),) = raised.value.failures.values()  # rank 0's own error, named
    assert isinstance(error, OSError) and error.errno == 28
    assert len(os.listdir("/proc/self/fd")) == descriptors
