"""The direct safetensors writer: the library's own bytes, read back by the library, past the page cache, and
nothing left behind when a write fails."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from tests.page_cache import resident_pages
from trainer_core import direct_write
from trainer_core.direct_write import DirectFile
from trainer_core.safetensors_write import write_safetensors


def mixed_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    wide = torch.randn(37, 301, generator=generator)
    return {
        "w.weight": wide,
        "w.t": wide.t(),  # not contiguous
        "b.half": torch.randn(5, 7, generator=generator).to(torch.bfloat16),
        "c.f16": torch.randn(9, generator=generator).half(),
        "step": torch.tensor(3.0),  # 0-d
        "empty": torch.zeros(0, 4),
        "ids": torch.arange(11, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(13, dtype=torch.uint8),
        "f64": torch.randn(3, generator=generator, dtype=torch.float64),
        "i32": torch.arange(-4, 3, dtype=torch.int32),
    }


@pytest.fixture(params=[4096, 8192, 2**20], ids=["one-block-chunks", "two-block-chunks", "one-chunk"])
def chunk_bytes(request, monkeypatch):
    """Small chunks make every tensor cross chunk boundaries; the tail is never a whole chunk."""
    monkeypatch.setattr(direct_write, "CHUNK_BYTES", request.param)
    return request.param


def test_the_file_is_the_librarys_own_bytes(tmp_path, chunk_bytes):
    for index, (tensors, metadata) in enumerate(
        [(mixed_tensors(), None), (mixed_tensors(), {"format": "pt"}), ({"s": torch.tensor(1.0)}, None), ({}, None)]
    ):
        path = tmp_path / f"{index}.safetensors"
        size = write_safetensors(path, tensors, metadata)
        expected = save({name: t.contiguous() for name, t in tensors.items()}, metadata=metadata)
        assert path.read_bytes() == expected and size == len(expected)


def test_the_library_reads_every_tensor_and_the_metadata_back(tmp_path, chunk_bytes):
    tensors = mixed_tensors()
    metadata = {"zeta": "1", "alpha": 'é"\n', "param_groups": '[{"lr": 0.1}]'}
    write_safetensors(tmp_path / "x.safetensors", tensors, metadata)
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as saved:
        assert saved.metadata() == metadata
        assert sorted(saved.keys()) == sorted(tensors)
        for name, tensor in tensors.items():
            read = saved.get_tensor(name)
            assert read.dtype == tensor.dtype and torch.equal(read, tensor), name


def test_a_large_file_goes_past_the_page_cache_where_the_filesystem_takes_o_direct(tmp_path):
    path = tmp_path / "big.safetensors"
    with DirectFile(tmp_path / "probe") as probe:
        direct = probe.direct
    tensors = {"w": torch.randn(16 * 2**20 // 4 * 3 + 123)}  # three chunks and a tail
    write_safetensors(path, tensors)
    pages = -(-path.stat().st_size // mmap.PAGESIZE)
    if direct:
        assert resident_pages(path) <= 2, "the bytes went through the page cache"
    else:  # this filesystem has no O_DIRECT: the cached path wrote it
        assert resident_pages(path) > pages // 2
    with safe_open(str(path), framework="pt") as saved:
        assert torch.equal(saved.get_tensor("w"), tensors["w"])


def test_a_filesystem_without_o_direct_gets_the_same_bytes_through_its_cache(tmp_path, monkeypatch, chunk_bytes):
    real_open = os.open

    def no_direct(path, flags, mode=0o777):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(direct_write.os, "open", no_direct)
    tensors = mixed_tensors()
    with DirectFile(tmp_path / "probe") as probe:
        assert not probe.direct
    write_safetensors(tmp_path / "x.safetensors", tensors)
    assert (tmp_path / "x.safetensors").read_bytes() == save({n: t.contiguous() for n, t in tensors.items()})


def test_a_filesystem_that_opens_o_direct_but_refuses_its_writes_is_written_through_its_cache(
    tmp_path, monkeypatch, chunk_bytes
):
    real_pwrite = os.pwrite

    def refuse_direct(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(direct_write.os, "pwrite", refuse_direct)
    tensors = mixed_tensors()
    write_safetensors(tmp_path / "x.safetensors", tensors)
    assert (tmp_path / "x.safetensors").read_bytes() == save({n: t.contiguous() for n, t in tensors.items()})
    write_safetensors(tmp_path / "tiny.safetensors", {"s": torch.tensor(1.0)})  # shorter than the probed block
    assert (tmp_path / "tiny.safetensors").read_bytes() == save({"s": torch.tensor(1.0)})


def test_a_failing_disk_raises_its_error_and_leaves_no_thread_or_descriptor(tmp_path, monkeypatch, chunk_bytes):
    real_pwrite, calls = os.pwrite, []

    def full_disk(fd, data, offset):
        calls.append(offset)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(direct_write.os, "pwrite", full_disk)
    descriptors = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="No space left"):
        write_safetensors(tmp_path / "x.safetensors", {"w": torch.randn(3 * chunk_bytes // 4)})
    assert len(os.listdir("/proc/self/fd")) == descriptors
    assert not [t for t in threading.enumerate() if t.name.startswith("direct-write")]


def test_an_unsupported_dtype_or_metadata_that_is_not_text_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="safetensors has no dtype for"):
        write_safetensors(tmp_path / "x.safetensors", {"z": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(TypeError, match=r"must map str to str; \['step'\]"):
        write_safetensors(tmp_path / "x.safetensors", {"w": torch.zeros(2)}, {"step": 5, "ok": "1"})  # type: ignore[dict-item]
    assert not (tmp_path / "x.safetensors").exists()


def test_a_link_where_the_file_goes_is_refused_and_what_it_points_to_is_untouched(tmp_path):
    target = tmp_path / "elsewhere.bin"
    target.write_bytes(b"keep me")
    (tmp_path / "x.safetensors").symlink_to(target)
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        write_safetensors(tmp_path / "x.safetensors", {"w": torch.zeros(2)})
    assert target.read_bytes() == b"keep me"
