"""Start real `rankflow` processes on a tiny config, and read what they left in the run directory and the store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from infra.publication.checkpoints import latest_checkpoint
from infra.publication.manifests import MANIFEST_FILE, checkpoint_key
from infra.runs import ledger
from infra.runs.run_lease import run_lease_path
from infra.store import open_store
from infra.store.lease import LeaseRecord, read_lease
from tasks.plan import compute_plan_fn
from tests import waits
from tests.bad_input.harness import to_toml
from tests.conftest import tiny_tree
from trainer_core.config import load_config
from trainer_core.run.faults import FAULT_ENV, FAULT_KIND_ENV
from trainer_core.run.progress import progress_path

REPO = Path(__file__).resolve().parents[3]


def rankflow_command() -> list[str]:
    script = Path(sys.executable).with_name("rankflow")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "flows.cli"]


def write_config(root: Path, **sections) -> Path:
    """A tiny run (two segments of 3 steps, one rank) under `root`; sections override keys.

    Named `lease` (default), so its run id and flow runs are these tests' own in the session's Prefect API.
    """
    tree = tiny_tree(
        root,
        **{
            "train": {"nproc_per_node": 1, **sections.pop("train", {})},
            "run": {"name": "lease", **sections.pop("run", {})},
            **sections,
        },
    )
    path = root / "run.toml"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(to_toml(tree))
    return path


def hanging_at(step: int, marker: Path) -> dict[str, str]:
    """Environment that makes rank 0 hang inside optimizer `step`, once (trainer_core/run/faults.py).

    The marker file appears as the rank starts hanging: a test waits for it, then
    acts on a run that is certainly mid-segment; a later run goes through.
    """
    return {FAULT_ENV: f"{step}:0:{marker}", FAULT_KIND_ENV: "hang"}


def client_env(api_url: str, home: Path) -> dict[str, str]:
    """A `rankflow` process that talks to the test's Prefect API instead of starting its own server."""
    return {
        **os.environ,
        "PREFECT_API_URL": api_url,
        "PREFECT_HOME": str(home),
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PYTHONPATH": str(REPO),
    }


def start(argv: list[str], env: dict[str, str], cwd: Path, *, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    """`rankflow ARGV` in its own process group (so a test can kill all of it), output to files in `cwd`."""
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [*prefix, *rankflow_command(), *argv],
        env=env,
        cwd=cwd,
        start_new_session=True,
        stdout=(cwd / "stdout.txt").open("w"),
        stderr=(cwd / "stderr.txt").open("w"),
    )


def finish(process: subprocess.Popen, cwd: Path, timeout_s: float = 600) -> tuple[int, dict | None, str]:
    """Wait for a run; returns its exit status, its summary line (JSON) and its standard error."""
    try:
        code = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise AssertionError(
            f"rankflow did not finish in {timeout_s} s:\n{(cwd / 'stderr.txt').read_text()[-4000:]}"
        ) from None
    lines = (cwd / "stdout.txt").read_text().strip().splitlines()
    summary = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
    return code, summary, (cwd / "stderr.txt").read_text()


def wait_for(condition: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.2):
    """`tests.waits.wait_for` with the bound first, as this module's callers pass it."""
    return waits.wait_for(condition, what, timeout_s=timeout_s, poll_s=poll_s)


def run_ids(work_dir: Path) -> list[str]:
    return sorted(p.name for p in work_dir.iterdir() if p.is_dir() and p.name != "cache") if work_dir.is_dir() else []


def lease_of(store_url: str, run_id: str) -> LeaseRecord | None:
    store = open_store(store_url)
    return read_lease(store, run_lease_path(store, run_id))


def trained_segments(run_dir: Path) -> list[int]:
    """The segments the ledger says were trained (not reused), in order, once per training."""
    return [e["segment"] for e in ledger.read(run_dir) if e["stage"] == "segment" and e["status"] == "completed"]


def committed_weights(store_url: str, run_id: str) -> dict[str, str]:
    """{file: sha256} of the weights (safetensors) of the run's newest committed checkpoint, from its manifest."""
    store = open_store(store_url)
    name = latest_checkpoint(store, run_id)
    assert name is not None, f"no committed checkpoint for {run_id}"
    manifest = json.loads(store.fs.cat_file(store.path(checkpoint_key(run_id, name, MANIFEST_FILE))))
    return {f["path"]: f["sha256"] for f in manifest["files"] if f["path"].endswith(".safetensors")}


def run_id_of(config_file: Path) -> str:
    return compute_plan_fn(load_config(config_file)).run_id


def stepping(run_dir: Path, segment: int) -> bool:
    """True once rank 0 recorded an optimizer step of `segment` (the launch is mid-segment)."""
    path = progress_path(run_dir, segment)
    return path.is_file() and any(
        json.loads(line).get("event") == "step" for line in path.read_text().splitlines() if line.strip()
    )


def raw_lease(store_url: str, run_id: str) -> LeaseRecord:
    """The run lease object as it is, released or not."""
    store = open_store(store_url)
    return LeaseRecord.from_bytes(store.fs.cat_file(run_lease_path(store, run_id)))


def steal(store, run_id: str, host: str = "gpu-node-9", pid: int = 4242, ttl_s: float = 600.0) -> LeaseRecord:
    """Overwrite the run lease with another machine's holder, as a takeover by a run there would."""
    path = run_lease_path(store, run_id)
    now = time.time()
    current = read_lease(store, path)
    thief = LeaseRecord(
        owner=f"{host}:{pid}",
        token="f" * 32,
        generation=(current.generation + 1 if current else 1),
        acquired_at=now,
        renewed_at=now,
        expires_at=now + ttl_s,
        ttl_s=ttl_s,
        host=host,
        pid=pid,
    )
    store.fs.pipe_file(path, thief.to_bytes())
    return thief
