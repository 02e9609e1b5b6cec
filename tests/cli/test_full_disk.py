"""A work dir whose disk fills up: the run says which disk, is not retried, and the rerun with space is bitwise right.

The work dir sits on a 4 MiB tmpfs (root only: the test skips where it cannot
mount one), too small for the first segment's state. The run used to end
with a JSONDecodeError from its own half-written ledger line, with no word of
the disk, and to retry into the full disk. The references: the bytes of the
ledger (every line whole), the disk the message names (the real mount), and
a run of the same config on an ordinary disk, whose committed weights the
rerun must equal byte for byte. Injected-ENOSPC unit tests of the same rules,
which need no root, are in tests/unit/test_no_space.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from pathlib import Path

import pytest

import flows.pipeline  # noqa: F401 - Prefect sets up its console logging at this import: here, outside capsys, so

# that later tests' log lines do not go to this test's closed capture (a RecursionError in Prefect's handler)
from flows.cli import main
from infra.publication.checkpoints import latest_checkpoint
from infra.store import open_store
from tests.conftest import tiny_tree

from .watched_run import toml_text as _toml

DISK_SIZE = "4m"

pytestmark = [pytest.mark.flow, pytest.mark.distributed]  # `rankflow run`: a Prefect flow over torchrun


@pytest.fixture
def small_disk(tmp_path):
    import os

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount_point = tmp_path / f"disk-{uuid.uuid4().hex[:8]}"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE}", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def _run(tmp_path: Path, name: str, work_dir: Path, store: Path, capsys) -> tuple[int, dict, str]:
    tree = tiny_tree(
        tmp_path,
        run={"work_dir": str(work_dir)},
        storage={"url": str(store)},
        train={"steps": 2, "steps_per_segment": 2, "global_batch_size": 4, "logical_dp": 1, "nproc_per_node": 1},
    )
    config = tmp_path / f"{name}.toml"
    config.write_text(_toml(tree))
    code = main(["run", str(config)])
    out, err = capsys.readouterr()
    return code, json.loads(out.strip().splitlines()[-1]), err


def _weights(store: Path, run_id: str) -> bytes:
    checkpoint = latest_checkpoint(open_store(str(store)), run_id)
    return (store / run_id / "checkpoints" / checkpoint / "model.safetensors").read_bytes()


def test_a_full_work_dir_is_named_not_retried_and_the_rerun_with_space_is_bitwise(
    prefect_harness, small_disk, tmp_path, capsys
):
    code, full, err = _run(tmp_path, "full", small_disk / "work", tmp_path / "store", capsys)
    assert code == 1 and full["run_id"] is not None, err[-3000:]
    assert full["failure_cause"] == "no_space" and full["failed_stage"] == "segment", full
    line = err.strip().splitlines()[-1]
    assert re.match(r"rankflow: run failed: segment failed( on rank \d+)?: no_space ", line), line
    assert f"no space on tmpfs:{small_disk}" in line and f"tmpfs mounted at {small_disk}" in line, line
    assert "attempt 1 of 3, not retried: a retry cannot help (no_space); free space on that disk" in line, line
    assert "JSONDecodeError" not in err
    ledger_file = small_disk / "work" / full["run_id"] / "ledger.jsonl"
    entries = [json.loads(text) for text in ledger_file.read_text().splitlines()]  # every line whole
    assert [e["failure"]["cause"] for e in entries if e["status"] == "failed"] in ([], ["no_space"])

    subprocess.run(["mount", "-o", "remount,size=256m", str(small_disk)], check=True)  # the operator frees space
    code, rerun, err = _run(tmp_path, "full", small_disk / "work", tmp_path / "store", capsys)
    assert code == 0 and rerun["run_id"] == full["run_id"], err[-3000:]

    code, reference, err = _run(
        tmp_path, "reference", tmp_path / "work-reference", tmp_path / "store-reference", capsys
    )
    assert code == 0 and reference["run_id"] == rerun["run_id"], err[-3000:]
    assert reference["losses"] == rerun["losses"]
    assert _weights(tmp_path / "store", rerun["run_id"]) == _weights(tmp_path / "store-reference", reference["run_id"])
