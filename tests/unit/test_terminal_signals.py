"""A suite started with SIGINT ignored (`nohup … &`) still starts its workers and servers as from a terminal
(`tests/terminal_signals.py`): a pytest session run under `trap "" INT` runs the probe, whose child must see
SIGINT at its default."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("sigint_probe.py")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_session_started_with_sigint_ignored_starts_children_as_from_a_terminal():
    pytest_command = shlex.join([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(PROBE)])
    done = subprocess.run(
        ["bash", "-c", f'trap "" INT; exec {pytest_command}'],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout
