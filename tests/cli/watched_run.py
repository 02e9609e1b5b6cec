"""One real `rankflow run` as a user starts it, watched: its config written, its own Prefect home and server.

The command runs under tests/cli/watch_exit.py (a child subreaper), which
reports its exit status, what it printed, how long after its last stdout line
it exited, and what it left running.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def toml_text(tree: dict) -> str:
    return "\n".join(
        f"[{section}]\n" + "\n".join(f"{key} = {json.dumps(value)}" for key, value in values.items())
        for section, values in tree.items()
    )


def rankflow_command() -> list[str]:
    script = Path(sys.executable).with_name("rankflow")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "flows.cli"]


def _run_config(root: Path, tree: dict) -> Path:
    config = root / "run.toml"
    config.write_text(toml_text(tree))
    return config


def _run_env(root: Path, env: dict[str, str] | None) -> dict[str, str]:
    child_env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PREFECT_HOME": str(root / "prefect-home"),
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        **(env or {}),
    }
    child_env.pop("PREFECT_API_URL", None)  # the command's own temporary server, as on a fresh machine
    return child_env


def watched_rankflow_run(root: Path, tree: dict, env: dict[str, str] | None = None) -> dict:
    """`rankflow run` of `tree` in `root` (its own PREFECT_HOME and temporary server, telemetry off), watched."""
    config = _run_config(root, tree)
    out = root / "watched.json"
    subprocess.run(
        [sys.executable, "-m", "tests.cli.watch_exit", str(out), "--", *rankflow_command(), "run", str(config)],
        cwd=root,
        env=_run_env(root, env),
        timeout=900,
        check=True,
    )
    return json.loads(out.read_text())


def started_rankflow_run(root: Path, tree: dict, env: dict[str, str] | None, output: Path) -> subprocess.Popen:
    """`rankflow run` of `tree` as `watched_rankflow_run` starts it, in a session of its own (as a terminal's
    foreground job: a Ctrl-C there is SIGINT to its process group); stdout to OUTPUT.out, stderr to OUTPUT.err."""
    config = _run_config(root, tree)
    with output.with_suffix(".out").open("w") as stdout, output.with_suffix(".err").open("w") as stderr:
        return subprocess.Popen(
            [*rankflow_command(), "run", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            cwd=root,
            env=_run_env(root, env),
            start_new_session=True,
        )
