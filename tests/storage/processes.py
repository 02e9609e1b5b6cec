"""Start helper processes from the repository (tests.storage.committer) with a given environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def spawn(module: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), child_env.get("PYTHONPATH")]))
    process = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env,
        cwd=REPO_ROOT,
        start_new_session=True,
    )
    return process


def wait_ready(process: subprocess.Popen) -> None:
    line = process.stdout.readline()
    if line.strip() != "ready":
        process.kill()
        raise AssertionError(f"helper did not start: {line!r} {process.stderr.read()[-2000:]}")


def result(process: subprocess.Popen, timeout_s: float = 600) -> dict:
    out, err = process.communicate(timeout=timeout_s)
    if process.returncode != 0:
        raise AssertionError(f"helper failed ({process.returncode}): {err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])
