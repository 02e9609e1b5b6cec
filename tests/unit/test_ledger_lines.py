"""Ledger lines are written whole or not at all, and a torn line never hides the others.

A full disk (ENOSPC) in the work dir used to leave half a JSON line at the
end of the ledger: reading it back raised JSONDecodeError, which replaced the
run's real error, and every later line was glued to the torn one. The
reference here is the bytes on disk: after a failed append the file is
exactly what it was; after a torn line (a crash mid-write by an older
version, or a kill), every whole line still reads back.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from infra.runs import ledger


def test_a_short_write_then_enospc_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    """The append loop under an injected short write (the real disk is below; this one runs without root)."""
    ledger.record(tmp_path, "plan", "completed", run_id="r")
    before = (tmp_path / ledger.LEDGER_FILE).read_bytes()
    real_write = os.write

    def write_half_then_fail(fd, data):  # what a filling disk does: a short write, then ENOSPC
        if len(data) > 40:
            return real_write(fd, bytes(data[:40]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", write_half_then_fail)
    with pytest.raises(OSError) as raised:
        ledger.record(tmp_path, "segment", "failed", error="x" * 500)
    assert raised.value.errno == errno.ENOSPC  # the real error, not a JSON error later
    monkeypatch.setattr(os, "write", real_write)
    assert (tmp_path / ledger.LEDGER_FILE).read_bytes() == before
    assert [e["stage"] for e in ledger.read(tmp_path)] == ["plan"]


def test_a_torn_line_is_skipped_and_the_next_line_starts_on_its_own(tmp_path):
    ledger.record(tmp_path, "plan", "completed")
    with (tmp_path / ledger.LEDGER_FILE).open("a") as handle:
        handle.write('{"time": 1.0, "stage": "segment", "status": "fai')  # torn: no end, no newline
    ledger.record(tmp_path, "segment", "failed", segment=0)
    entries = ledger.read(tmp_path)
    assert [(e["stage"], e["status"]) for e in entries] == [("plan", "completed"), ("segment", "failed")]
    lines = (tmp_path / ledger.LEDGER_FILE).read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[2])["segment"] == 0


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB tmpfs (root only), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount_point = tmp_path / f"disk-{uuid.uuid4().hex[:8]}"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def _fill(path: Path) -> None:
    with path.open("wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * 4096)
        except OSError as error:
            assert error.errno == errno.ENOSPC


def test_a_real_full_disk_keeps_the_ledger_whole(tiny_disk):
    run_dir = tiny_disk / "run"
    ledger.record(run_dir, "plan", "completed", note="a" * 3000)  # most of the ledger's first page
    _fill(tiny_disk / "filler")
    before = (run_dir / ledger.LEDGER_FILE).read_bytes()
    with pytest.raises(OSError) as raised:
        ledger.record(run_dir, "segment", "failed", error="b" * 8000)  # needs pages the disk no longer has
    assert raised.value.errno == errno.ENOSPC
    assert (run_dir / ledger.LEDGER_FILE).read_bytes() == before
    (tiny_disk / "filler").unlink()
    ledger.record(run_dir, "segment", "failed", error="b" * 8000)  # with space again, the line lands whole
    assert [e["stage"] for e in ledger.read(run_dir)] == ["plan", "segment"]
