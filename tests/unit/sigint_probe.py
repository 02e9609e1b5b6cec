"""Run by `test_terminal_signals.py` in a pytest session started with SIGINT ignored (not collected by the suite):
a process a test starts must not inherit SIGINT ignored."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path


def test_a_child_does_not_start_with_sigint_ignored():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        status = Path(f"/proc/{child.pid}/status").read_text()  # read after its exec: Popen waits for it
    finally:
        child.kill()
        child.wait()
    ignored = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    assert not ignored & (1 << (signal.SIGINT - 1)), f"SigIgn {ignored:#x}: the child ignores SIGINT"
