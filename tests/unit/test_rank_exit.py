"""A finished rank (and torchrun after it) leaves with `leave_now`: at once, but with everything it said."""

from __future__ import annotations

import os
import subprocess
import sys


def test_a_rank_that_leaves_at_once_still_says_what_it_buffered_and_exits_with_its_code():
    """`leave_now` skips the interpreter's teardown (os._exit): what sits in Python's stream buffers must still
    reach the pipe (a rank's last lines, the CLI's result line)."""
    leaving = (
        "import sys; from trainer_core.run.rank_process import leave_now; "
        "sys.stdout.write('last line, no newline'); sys.stderr.write('warning'); leave_now(3)"
    )
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as a rank's stdout to a file is
    done = subprocess.run([sys.executable, "-c", leaving], capture_output=True, text=True, timeout=120, env=buffered)
    assert (done.returncode, done.stdout, done.stderr) == (3, "last line, no newline", "warning")
