"""Reading a state ahead: its files end up in the page cache, unless they would not fit; links are not followed."""

from __future__ import annotations

import torch

from tests.page_cache import resident_pages
from trainer_core.run import state_readahead
from trainer_core.run.state_readahead import read_ahead
from trainer_core.safetensors_write import write_safetensors


def written_past_the_cache(tmp_path):
    state = tmp_path / "segment-0000"
    (state / "base").mkdir(parents=True)
    for name, numel in (("params", 3_000_000), ("optimizer", 6_000_000)):
        write_safetensors(state / "base" / f"{name}.safetensors", {"w": torch.randn(numel)})
    return state, sorted((state / "base").iterdir())


def test_the_state_is_in_the_page_cache_once_the_reader_ends(tmp_path):
    state, files = written_past_the_cache(tmp_path)
    before = sum(resident_pages(f) for f in files)
    reader = read_ahead(state)
    assert reader is not None and reader.daemon
    reader.join(timeout=60)
    pages = sum(-(-f.stat().st_size // 4096) for f in files)
    assert sum(resident_pages(f) for f in files) >= pages - 2 > before


def test_a_state_larger_than_half_the_available_memory_is_left_on_disk(tmp_path, monkeypatch):
    state, files = written_past_the_cache(tmp_path)
    size = sum(f.stat().st_size for f in files)
    monkeypatch.setattr(state_readahead, "available_memory_bytes", lambda: 2 * size - 2)
    assert read_ahead(state) is None
    monkeypatch.setattr(state_readahead, "available_memory_bytes", lambda: None)  # unknown: not read either
    assert read_ahead(state) is None
    monkeypatch.setattr(state_readahead, "available_memory_bytes", lambda: 2 * size)
    reader = read_ahead(state)
    assert reader is not None
    reader.join(timeout=60)


def test_nothing_is_read_where_there_is_no_state_and_links_are_not_followed(tmp_path):
    assert read_ahead(tmp_path / "absent") is None
    outside, files = written_past_the_cache(tmp_path / "outside")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "params.safetensors").symlink_to(files[0])
    assert read_ahead(linked) is None
    assert resident_pages(files[0]) <= 2
