"""Reading a safetensors file past the page cache into memory of the process's own: the library's values, no map of
the file and the page cache left alone, the fallback where O_DIRECT is refused, damage refused."""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.page_cache import resident_pages
from trainer_core.safetensors_read import read_safetensors
from trainer_core.safetensors_write import DTYPES, write_safetensors


def _mapping_of(address: int) -> str | None:
    """What the mapping holding `address` maps (a path, or '' for anonymous memory); None where nothing is."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(bound, 16) for bound in fields[0].split("-"))
        if low <= address < high:
            return fields[5] if len(fields) == 6 else ""
    return None


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = {
        f"t.{str(dtype).removeprefix('torch.')}": (torch.randn(5, 3, generator=generator) * 50).to(dtype)
        for dtype in DTYPES
    }
    tensors |= {
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "large": torch.randn(3_000_000, generator=generator),  # spans more than one read of the reader's
    }
    return tensors


@pytest.mark.parametrize("writer", ["library", "rankflow"])
def test_every_tensor_and_the_metadata_are_the_library_s(tmp_path, writer, monkeypatch):
    from trainer_core import safetensors_read

    monkeypatch.setattr(safetensors_read, "READ_BYTES", 1 << 20)  # many reads per tensor
    tensors, path = _tensors(), tmp_path / "file.safetensors"
    if writer == "library":
        save_file(tensors, str(path), metadata={"format": "x", "more": "y"})
    else:
        write_safetensors(path, tensors, {"format": "x", "more": "y"})
    read, metadata = read_safetensors(path)
    assert metadata == {"format": "x", "more": "y"}
    with safe_open(str(path), framework="pt") as reference:
        assert sorted(read) == sorted(reference.keys())
        for name in read:
            expected = reference.get_tensor(name)
            assert read[name].dtype == expected.dtype and read[name].shape == expected.shape
            assert torch.equal(read[name].view(-1).view(torch.uint8), expected.view(-1).view(torch.uint8)), name


def test_the_tensors_are_the_process_s_own_memory_not_a_map_of_the_file_nor_the_page_cache(tmp_path):
    path = tmp_path / "moments.safetensors"
    write_safetensors(path, {"exp_avg": torch.randn(2_000_000), "exp_avg_sq": torch.rand(2_000_000)})
    before = path.read_bytes()
    read, _ = read_safetensors(path)
    with safe_open(str(path), framework="pt") as mapped:  # the contrast: the library's tensors map the file
        assert str(path) in (_mapping_of(mapped.get_tensor("exp_avg").data_ptr()) or "")
    for tensor in read.values():
        assert str(path) not in (_mapping_of(tensor.data_ptr()) or "")
        tensor.mul_(2)  # written in place, as the first optimizer step does
    assert path.read_bytes() == before


def test_the_file_is_read_past_the_page_cache(tmp_path):
    path = tmp_path / "moments.safetensors"
    write_safetensors(path, {"exp_avg": torch.randn(8_000_000), "exp_avg_sq": torch.rand(8_000_000)})  # 64 MB
    pages = -(-path.stat().st_size // 4096)
    assert resident_pages(path) <= 2
    read, _ = read_safetensors(path)
    # The library's check of the header maps the file and faults its first page in, with one read-ahead window
    # (8 MB here); a map of the tensors, or reads through the cache, would leave every page there.
    assert resident_pages(path) <= pages // 4
    assert torch.equal(read["exp_avg_sq"], load_file(str(path))["exp_avg_sq"])


def test_a_file_system_that_refuses_o_direct_is_read_through_its_cache(tmp_path, monkeypatch):
    from trainer_core import safetensors_read

    path = tmp_path / "moments.safetensors"
    tensors = {"w": torch.randn(300_000), "v": torch.randn(7)}
    write_safetensors(path, tensors)
    real_preadv = os.preadv

    def refusing(descriptor, buffers, offset):  # as older overlayfs and some FUSE file systems do
        if fcntl.fcntl(descriptor, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(descriptor, buffers, offset)

    monkeypatch.setattr(safetensors_read.os, "preadv", refusing)
    read, _ = read_safetensors(path)
    assert all(torch.equal(read[name], tensors[name]) for name in tensors)


def test_a_file_shorter_than_its_header_says_is_refused_and_names_itself(tmp_path):
    path = tmp_path / "cut.safetensors"
    write_safetensors(path, {"w": torch.randn(10_000)})
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"cut\.safetensors is not a whole safetensors file"):
        read_safetensors(path)


def test_read_through_the_cache_where_several_ranks_read_it_and_small_tensors_own_their_memory(tmp_path):
    path = tmp_path / "moments.safetensors"
    tensors = {"exp_avg": torch.randn(2_000_000), "step": torch.tensor(7.0)}
    write_safetensors(path, tensors)
    read, _ = read_safetensors(path, direct=False)
    assert resident_pages(path) >= -(-path.stat().st_size // 4096) - 2  # the cache serves the next reader
    assert all(torch.equal(read[name], tensors[name]) for name in tensors)
    # AdamW's step is left on the CPU when the moments move to a GPU: it must not keep the whole buffer alive.
    size = path.stat().st_size
    assert abs(read["step"].data_ptr() - read["exp_avg"].data_ptr()) > size  # its own memory, not in the buffer


def test_a_file_whose_tensors_change_between_the_check_and_the_read_is_refused(tmp_path, monkeypatch):
    from trainer_core import safetensors_read

    path, other = tmp_path / "moments.safetensors", tmp_path / "other.safetensors"
    write_safetensors(path, {"exp_avg": torch.randn(1000)})
    write_safetensors(other, {"exp_avg_sq": torch.randn(1000)})
    real_check = safetensors_read.check_safetensors

    def check_then_swap(checked):
        layouts = real_check(checked)
        other.replace(checked)  # swapped after the library checked it
        return layouts

    monkeypatch.setattr(safetensors_read, "check_safetensors", check_then_swap)
    with pytest.raises(ValueError, match="changed while it was read"):
        read_safetensors(path)


@pytest.mark.parametrize(
    "replacement",
    [
        pytest.param({"exp_avg": torch.arange(1000, dtype=torch.int32)}, id="same name and size, another dtype"),
        pytest.param({"exp_avg": torch.randn(10, 100)}, id="same name and size, another shape"),
        pytest.param(None, id="not a safetensors file"),
    ],
)
def test_a_file_swapped_for_one_of_the_same_size_between_the_check_and_the_read_is_refused(
    tmp_path, monkeypatch, replacement
):
    """Same tensor names and byte counts, other dtype or shape (or junk): the bytes would be read under the checked
    layout, reinterpreted; the header read with them is held to every part of that layout."""
    from trainer_core import safetensors_read

    path, other = tmp_path / "moments.safetensors", tmp_path / "other.safetensors"
    write_safetensors(path, {"exp_avg": torch.randn(1000)})
    if replacement is None:
        other.write_bytes(b"\xff" * path.stat().st_size)
    else:
        write_safetensors(other, replacement)
    real_check = safetensors_read.check_safetensors

    def check_then_swap(checked):
        layouts = real_check(checked)
        other.replace(checked)
        return layouts

    monkeypatch.setattr(safetensors_read, "check_safetensors", check_then_swap)
    with pytest.raises(ValueError, match="changed while it was read"):
        read_safetensors(path)


def test_a_file_written_to_while_it_is_read_is_refused_not_read_half_old_half_new(tmp_path, monkeypatch):
    """A writer rewriting the file in place (`save_checkpoint` into the directory being restored) after the first
    read call: the bytes read would mix two versions of the same layout; the read is refused."""
    from trainer_core import safetensors_read

    path = tmp_path / "moments.safetensors"
    write_safetensors(path, {"exp_avg": torch.zeros(100_000)})
    monkeypatch.setattr(safetensors_read, "READ_BYTES", 64 * 1024)
    real_preadv, calls = os.preadv, []

    def read_then_rewrite(descriptor, buffers, offset):
        count = real_preadv(descriptor, buffers, offset)
        if not calls:
            time.sleep(0.02)  # past the kernel's coarse clock tick, as a real writer is
            write_safetensors(path, {"exp_avg": torch.ones(100_000)})  # same layout, other bytes, in place
        calls.append(offset)
        return count

    monkeypatch.setattr(safetensors_read.os, "preadv", read_then_rewrite)
    with pytest.raises(ValueError, match="written to during the read"):
        read_safetensors(path)
    assert len(calls) > 1  # the rewrite came mid-read
