"""The pre-flight checks: good input passes untouched, the plan-size bound is right, files are opened safely."""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flows.cli.schedule import check_schedule
from tests.bad_input.harness import Assets
from tests.conftest import EXAMPLES, tiny_tree
from trainer_core.config import ConfigError, config_from_dict
from trainer_core.input_files import open_input
from trainer_core.run.plan import build_plan
from trainer_core.run.plan_size import PlanSize, _steps_in_memory, check_plan_size, estimate_plan_size
from trainer_core.run.validate import validate_inputs
from trainer_core.storage_url import check_storage_url


def test_good_inputs_pass_and_nothing_is_written(tmp_path):
    config = config_from_dict(tiny_tree(tmp_path), config_dir=tmp_path)
    checked = validate_inputs(config)
    assert checked.prepared.num_records > 0 and not (tmp_path / "work").exists()
    checked.store_cache()  # the caller decides: only then is the stage cache written
    assert list((tmp_path / "work" / "cache").glob("*.store"))


def test_plan_after_preflight_is_the_plan_without_it(tmp_path):
    config = config_from_dict(tiny_tree(tmp_path), config_dir=tmp_path)
    alone, _ = build_plan(config)
    after, _ = build_plan(config, validate_inputs(config))
    assert alone.digest == after.digest


def test_a_saved_model_directory_passes(tmp_path):
    model_dir = Assets(tmp_path).model_dir()
    config = config_from_dict(tiny_tree(tmp_path, model={"config": None, "path": str(model_dir)}), config_dir=tmp_path)
    assert validate_inputs(config).model_config.vocab_size == 1024


@pytest.mark.parametrize(
    "url",
    [
        "s3://rankflow",
        "s3://rankflow/runs/team-a",
        "s3://my.bucket-1/a/",
        "file:///tmp/x",
        "relative/store",
        "/abs/store",
        "file://relative",
    ],
)
def test_storage_urls_that_are_fine(url):
    assert check_storage_url(url) == url


@pytest.mark.parametrize("size", ["2GB", "500MB", "1GiB", "64KB"])
def test_shard_sizes_that_are_fine(tmp_path, size):
    assert (
        config_from_dict(
            tiny_tree(tmp_path, export={"max_shard_size": size}), config_dir=tmp_path
        ).export.max_shard_size
        == size
    )


@pytest.mark.parametrize(
    ("cron", "interval"), [("0 3 * * *", None), ("*/15 * * * 1-5", None), (None, 3600.0), (None, 0.5)]
)
def test_schedules_that_are_fine(cron, interval):
    check_schedule(cron, interval)


def test_a_fifo_fails_at_once_instead_of_blocking(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    refused: list[str] = []

    def read() -> None:
        try:
            open_input(fifo, "data", "fix")
        except ConfigError as error:
            refused.append(str(error))

    # Opening a FIFO for reading blocks until a writer comes: nothing writes, so a reader that opened it never ends.
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(300)
    blocked = reader.is_alive()
    if blocked:
        with open(fifo, "w"):  # a writer lets the blocked open return, so the thread ends
            pass
    assert not blocked, "open_input blocked on the FIFO, waiting for a writer"
    assert refused and re.search(r"data: is a FIFO \(named pipe\), not a regular file; fix", refused[0])


def test_permission_denied_names_the_fix(tmp_path, monkeypatch):
    # Root reads any file, so the kernel's refusal is simulated here (test_corpus.py runs the real one as nobody).
    def refuse(*_args, **_kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(
        ConfigError, match=r"^data: cannot be read \(permission denied\); make it readable by this user"
    ):
        open_input(tmp_path / "x.jsonl", "data", "fix")


def test_the_estimate_bounds_the_real_shards(tmp_path):
    for sections in (
        {},
        {"data": {"pack": True}},
        {"data": {"path": str(EXAMPLES / "tiny" / "rl.jsonl"), "kind": "rl", "max_seq_len": 160}},
    ):
        config = config_from_dict(tiny_tree(tmp_path, **sections), config_dir=tmp_path)
        size = estimate_plan_size(config, validate_inputs(config).prepared)
        _, shards = build_plan(config)
        real = sum(t.numel() * t.element_size() for tensors in shards.values() for t in tensors.values())
        # An upper bound, and a tight one: rows are padded to the longest document at most.
        assert real <= size.shard_bytes <= 2 * real, (sections, real, size.shard_bytes)


@settings(max_examples=200, deadline=None)
@given(
    steps_per_segment=st.integers(1, 10**6),
    batch=st.integers(1, 512),
    bytes_per_row=st.integers(8, 10**5),
    memory_bytes=st.integers(0, 10**12),
    conversations=st.integers(0, 10**9),
)
def test_the_steps_that_fit_are_the_most_that_fit(steps_per_segment, batch, bytes_per_row, memory_bytes, conversations):
    from types import SimpleNamespace

    config = SimpleNamespace(train=SimpleNamespace(global_batch_size=batch, steps_per_segment=steps_per_segment))
    size = PlanSize(
        row_len=8, bytes_per_row=bytes_per_row, shard_bytes=0, peak_memory_bytes=0, conversation_bytes=conversations
    )

    def peak(steps):  # estimate_plan_size's peak, for `steps`: one segment held twice, the order, the conversations
        return conversations + steps * batch * 16 + 2 * min(steps_per_segment, steps) * batch * bytes_per_row

    fit = _steps_in_memory(config, size, memory_bytes)
    assert peak(fit) <= memory_bytes < peak(fit + 1) or (fit == 0 and memory_bytes < peak(1))


def test_the_advised_steps_do_fit(tmp_path):
    config = config_from_dict(
        tiny_tree(tmp_path, train={"steps": 10_000, "steps_per_segment": 100}), config_dir=tmp_path
    )
    prepared = validate_inputs(config).prepared
    memory = estimate_plan_size(config, prepared).peak_memory_bytes // 3
    with pytest.raises(
        ConfigError, match=r"train\.steps=10000: planning would hold .* lower train\.steps to at most (\d+)"
    ) as raised:
        check_plan_size(config, prepared, memory_bytes=memory, disk_bytes=2**60)
    advised = int(raised.value.args[0].split("at most ")[1].split(",")[0])
    fitting = config_from_dict(
        tiny_tree(tmp_path, train={"steps": advised, "steps_per_segment": 100}), config_dir=tmp_path
    )
    assert check_plan_size(fitting, prepared, memory_bytes=memory, disk_bytes=2**60).peak_memory_bytes <= memory


def test_the_disk_bounds_the_shards_too(tmp_path):
    config = config_from_dict(tiny_tree(tmp_path), config_dir=tmp_path)
    prepared = validate_inputs(config).prepared
    with pytest.raises(
        ConfigError,
        match=r"the plan's shards would take .* but run\.work_dir=.* has 0\.0 GiB free; not even one step fits",
    ):
        check_plan_size(config, prepared, memory_bytes=2**60, disk_bytes=0)


def test_a_model_config_is_read_with_json_positions(tmp_path):
    bad = tmp_path / "model.json"
    bad.write_text(json.dumps({"model_type": "qwen3"})[:-1] + ',\n "x": }')
    config = config_from_dict(tiny_tree(tmp_path, model={"config": str(bad)}), config_dir=tmp_path)
    with pytest.raises(ConfigError, match=rf"^{bad}:2:7: not valid JSON"):
        validate_inputs(config)
    assert not Path(tmp_path / "work").exists()


def test_data_rewritten_between_its_hash_and_its_reading_is_refused(tmp_path, monkeypatch):
    """The fingerprint names the bytes hashed; the records staged must be those bytes, or the plan (and the stage
    cache under that digest) would hold other data than the run id says."""
    import trainer_core.run.validate as validate

    data = tmp_path / "data.jsonl"
    data.write_bytes((EXAMPLES / "tiny" / "sft.jsonl").read_bytes())
    config = config_from_dict(tiny_tree(tmp_path, data={"path": str(data)}), config_dir=tmp_path)
    hashed = validate.data_digest
    calls = []

    def hash_then_rewrite(files):
        digest = hashed(files)
        if not calls:  # the first hash: then a writer appends a record before the file is read
            data.write_bytes(data.read_bytes() * 2)
        calls.append(digest)
        return digest

    monkeypatch.setattr(validate, "data_digest", hash_then_rewrite)
    with pytest.raises(validate.DataError, match="changed while it was read"):
        validate_inputs(config)
    assert not (tmp_path / "work").exists()
