"""Run a command and report when its last stdout line came, when it exited, and what it left running.

`python -m tests.cli.watch_exit OUT -- COMMAND...` writes OUT (JSON): the exit
status, stdout and stderr, the seconds from the last stdout line to the exit,
and the processes the command left behind. This process makes itself a child
subreaper (PR_SET_CHILD_SUBREAPER), so every descendant that outlives the
command is re-parented here, where it is listed, then killed and reaped.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36


def _children() -> list[dict]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == os.getpid():
            found.append({"pid": int(entry.name), "state": fields[0], "cmdline": cmdline[:300]})
    return found


def main(out: Path, command: list[str]) -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: dict[str, list] = {"stdout": [], "stderr": []}

    def pump(name: str, stream) -> None:
        for line in stream:
            lines[name].append((time.monotonic(), line))

    pumps = [threading.Thread(target=pump, args=(name, getattr(process, name))) for name in lines]
    for thread in pumps:
        thread.start()
    returncode = process.wait()
    exited = time.monotonic()
    for thread in pumps:
        thread.join()
    left = [c for c in _children() if c["state"] != "Z"]  # the command's own zombie was reaped by wait()
    for child in _children():
        try:
            os.kill(child["pid"], signal.SIGKILL)
            os.waitpid(child["pid"], 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    last_stdout = lines["stdout"][-1][0] if lines["stdout"] else None
    out.write_text(
        json.dumps(
            {
                "returncode": returncode,
                "wall_s": exited - started,
                "stdout": "".join(line for _, line in lines["stdout"]),
                "stderr": "".join(line for _, line in lines["stderr"]),
                "exit_after_last_stdout_s": None if last_stdout is None else exited - last_stdout,
                "left_behind": left,
            }
        )
    )


if __name__ == "__main__":
    separator = sys.argv.index("--")
    main(Path(sys.argv[1]), sys.argv[separator + 1 :])
