"""Reading a state ahead: the files its ranks read through the page cache end up there (not the AdamW moments, which
they read past it), unless they would not fit; links are not followed; started at the save, read once."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.page_cache import resident_pages
from tests.unit.test_state_record import planned  # noqa: F401 - the fixture
from trainer_core.run import state_readahead
from trainer_core.run.state_readahead import ReadAheadWhenSaved, read_ahead
from trainer_core.safetensors_write import write_safetensors


def written_past_the_cache(tmp_path):
    state = tmp_path / "segment-0000"
    (state / "base").mkdir(parents=True)
    for name, numel in (("params", 3_000_000), ("optimizer", 6_000_000)):
        write_safetensors(state / "base" / f"{name}.safetensors", {"w": torch.randn(numel)})
    return state, sorted((state / "base").iterdir())


def test_the_weights_are_in_the_page_cache_once_the_reader_ends_and_the_moments_are_not(tmp_path):
    state, (optimizer, params) = written_past_the_cache(tmp_path)
    before = resident_pages(params)
    reader = read_ahead(state)
    assert reader is not None and reader.daemon
    reader.join(timeout=300)  # ends as soon as the files are read
    assert resident_pages(params) >= -(-params.stat().st_size // 4096) - 2 > before
    assert (
        resident_pages(optimizer) <= 2
    )  # the ranks read the moments past the cache (trainer_core/safetensors_read.py)


def test_a_launch_of_several_ranks_per_node_has_the_moments_read_ahead_too(tmp_path):
    state, (optimizer, params) = written_past_the_cache(tmp_path)
    reader = read_ahead(state, moments=True)
    assert reader is not None
    reader.join(timeout=300)  # ends as soon as the files are read
    for path in (optimizer, params):
        assert resident_pages(path) >= -(-path.stat().st_size // 4096) - 2


def test_a_state_larger_than_half_the_available_memory_is_left_on_disk(tmp_path, monkeypatch):
    state, files = written_past_the_cache(tmp_path)
    size = files[1].stat().st_size  # the weights: the moments are not read ahead
    monkeypatch.setattr(state_readahead, "available_memory_bytes", lambda: 2 * size - 2)
    assert read_ahead(state) is None
    monkeypatch.setattr(state_readahead, "available_memory_bytes", lambda: None)  # unknown: not read either
    assert read_ahead(state) is None
    monkeypatch.setattr(state_readahead, "available_memory_bytes", lambda: 2 * size)
    reader = read_ahead(state)
    assert reader is not None
    reader.join(timeout=300)  # ends as soon as the files are read


def test_nothing_is_read_where_there_is_no_state_and_links_are_not_followed(tmp_path):
    assert read_ahead(tmp_path / "absent") is None
    outside, files = written_past_the_cache(tmp_path / "outside")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "params.safetensors").symlink_to(files[1])
    assert read_ahead(linked) is None
    assert resident_pages(files[1]) <= 2


def test_a_segment_s_watch_reads_its_state_ahead_from_its_saved_record_and_the_next_task_joins_that_read(
    tmp_path, monkeypatch
):
    state, (_optimizer, params) = written_past_the_cache(tmp_path)
    reading = threading.Event()
    let_go = threading.Event()
    real_read = state_readahead._read

    def slow_read(files):
        reading.set()
        let_go.wait(300)  # until the test lets it go
        real_read(files)

    monkeypatch.setattr(state_readahead, "_read", slow_read)
    when_saved = ReadAheadWhenSaved(state)
    when_saved([{"event": "step"}, {"event": "saving"}])
    assert when_saved.started is None and not reading.is_set()
    when_saved([{"event": "saved"}])
    assert when_saved.started is not None and reading.wait(300)
    assert read_ahead(state) is when_saved.started  # the next segment's task: the same read, not a second one
    when_saved([{"event": "saved"}])  # a record seen again starts nothing
    let_go.set()
    when_saved.started.join(300)
    assert resident_pages(params) >= -(-params.stat().st_size // 4096) - 2
    assert read_ahead(state) is when_saved.started  # done: read once per state, not again by the next task


class _Stop(Exception):
    pass


def test_the_next_segments_task_reads_the_previous_state_ahead_before_its_input_check(planned, monkeypatch):  # noqa: F811
    """The wiring: segment 1's task starts the read of segment 0's state, then checks its inputs."""
    from pathlib import Path

    from tasks import segment as segment_task
    from trainer_core.run.state import state_dir_for

    calls = []
    monkeypatch.setattr(segment_task, "read_ahead", lambda state_dir, moments: calls.append(("read", state_dir)))

    def inputs(planned_run, segment_index):
        calls.append(("inputs", segment_index))
        raise _Stop

    monkeypatch.setattr(segment_task, "fetch_segment_inputs", inputs)
    with pytest.raises(_Stop):
        segment_task.train_segment_fn(planned, 1, on_line=lambda _line: None)
    assert calls == [("read", state_dir_for(Path(planned.run_dir), 0)), ("inputs", 1)]
