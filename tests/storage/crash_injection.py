"""SIGKILL a committing process at each phase boundary and at random moments, then retry: crash injection.

    python -m tests.storage.crash_injection --trials 200 [--seed S] [--large] [--boundaries]
    (starts its own SeaweedFS)

Each trial stages a checkpoint of a few files, starts a committer process
(tests.storage.committer) that waits for a go, and kills it with SIGKILL:

- with `boundaries`, once at each event of an uninterrupted commit, in order
  (the go, the lease, each finished upload while the others are still in
  flight, the manifest before and after its write, LATEST read and moved,
  the journal's COMMITTED): the committer kills itself there, so every phase
  is hit exactly once, whatever the machine's load;
- then `num_trials` times a random time after the go, uniform over
  [0, 1.2 × an uninterrupted commit], for the moments between the events
  (inside a request, between a write and its answer).

After each kill:

- nothing partial is visible: every listed checkpoint verifies byte for byte,
  and the trial's step is visible only if complete;
- LATEST never moved back (steps grow from trial to trial);
- a retry in this process finishes the commit (the dead holder's finalizer
  lease is taken over at once), and re-uploads no object that was already
  complete with the right size and sha256 — the bytes re-uploaded are counted.

`run_trials` is shared with tests/storage/test_crash_injection.py.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from infra.publication.checkpoints import verify_checkpoint
from infra.publication.commit import commit_checkpoint, read_staged_manifest, remote_dir
from infra.publication.latest import read_latest
from infra.publication.manifests import checkpoint_name
from infra.store import open_store
from infra.store.base import StoreLocation
from infra.store.objects import matches
from tests.publication_helpers import stage
from tests.storage.processes import result, spawn, wait_ready

RUN = "crash-run"


@dataclass
class CrashSummary:
    trials: int = 0
    killed_mid_commit: int = 0
    """Kills that landed before the commit finished (the rest hit a finished commit)."""
    commit_events: list[str] = field(default_factory=list)
    """The events of an uninterrupted commit, in order (the probe's)."""
    killed_at: list[str] = field(default_factory=list)
    """The event each boundary trial's committer killed itself at."""
    visible_partial: int = 0
    visible_complete_after_kill: int = 0
    latest_moved_back: int = 0
    recovered: int = 0
    bytes_staged: int = 0
    bytes_complete_before_retry: int = 0
    bytes_uploaded_on_retry: int = 0
    bytes_reuploaded_complete: int = 0
    """Bytes of objects that were already complete before the retry and were uploaded again (must be 0)."""
    bytes_landed_after_check: int = 0
    """Bytes of objects the killed committer had fully sent whose write the server applied only after the
    check (the answer was lost with the process): the retry finds them complete and skips them; the
    full verify after the retry reads them byte for byte."""
    failures: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _files(rng: random.Random, large: bool) -> dict[str, bytes]:
    sizes = [rng.randint(50_000, 1_000_000) for _ in range(4)] + [rng.randint(100, 5_000)]
    if large:
        sizes.append(70 * 2**20)  # past the multipart threshold
    return {f"model-{i:05d}-of-{len(sizes):05d}.safetensors": os.urandom(size) for i, size in enumerate(sizes)}


def _spawn_committer(staged: Path, store_url: str, env: dict[str, str], kill_at: int | None = None):
    """A committer that imports and connects in the background; `wait_ready` it before its go."""
    kill = [] if kill_at is None else ["--kill-at", str(kill_at)]
    return spawn("tests.storage.committer", [str(staged), RUN, store_url, "--wait-go", *kill], env)


def _kill_at_boundary(child) -> str | None:
    """The event a `--kill-at` committer killed itself at; None when it finished first."""
    child.wait(timeout=120)
    killed = [line for line in child.stdout.read().splitlines() if line.startswith("killed at ")]
    return killed[0].removeprefix("killed at ") if killed else None


def _kill_after(child, delay_s: float) -> bool:
    """SIGKILL the committer `delay_s` after its go; whether it had finished first."""
    time.sleep(delay_s)
    finished_first = child.poll() is not None
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # it had finished and exited already
    child.wait()
    return finished_first


def _committer(staged: Path, store_url: str, env: dict[str, str]):
    process = _spawn_committer(staged, store_url, env)
    wait_ready(process)
    return process


def _check_visible(store: StoreLocation, summary: CrashSummary, step: int, label: str) -> None:
    """Only this trial's step can have changed: once its manifest is there, every byte must verify."""
    report = verify_checkpoint(store, RUN, checkpoint_name(step), full=True)
    if report.manifest is None:
        return  # not visible: no reader lists a checkpoint without its manifest
    if report.verified:
        summary.visible_complete_after_kill += 1
    else:
        summary.visible_partial += 1
        summary.failures.append(f"{label}: {checkpoint_name(step)} listed but does not verify")


def run_trials(
    store_url: str,
    work: Path,
    num_trials: int,
    seed: int,
    env: dict[str, str] | None = None,
    large: bool = False,
    boundaries: bool = False,
) -> CrashSummary:
    """`num_trials` random kills, after one kill at each event of a commit when `boundaries`."""
    env = env or {}
    rng = random.Random(seed)
    store = open_store(store_url)
    summary = CrashSummary()
    # One uninterrupted commit sets the kill window and lists the events a commit passes.
    probe = stage(work / "probe", 1, _files(rng, large), run_id=RUN)
    child = _committer(probe, store_url, env)
    started = time.monotonic()
    child.stdin.write("go\n"), child.stdin.flush()
    summary.commit_events = result(child)["events"]
    window_s = 1.2 * (time.monotonic() - started)
    # Kill at event 0 (the go) to the last event, then at random times.
    kill_points = ([*range(len(summary.commit_events) + 1)] if boundaries else []) + [None] * num_trials
    latest_step = 1
    staged = stage(work / "t0", 10, _files(rng, large), run_id=RUN)
    child = _spawn_committer(staged, store_url, env, kill_points[0])
    for trial, kill_at in enumerate(kill_points):
        step = 10 * (trial + 1)
        wait_ready(child)  # imported and connected: the kill window starts at the go, as for the probe
        child.stdin.write("go\n"), child.stdin.flush()
        if kill_at is None:
            delay_s = rng.uniform(0, window_s)
            finished_first = _kill_after(child, delay_s)
            label = f"trial {trial} (step {step}, kill after {delay_s:.3f} s of {window_s:.3f})"
        else:
            event = _kill_at_boundary(child)
            finished_first = event is None
            summary.killed_at.append(event or "finished")
            label = f"trial {trial} (step {step}, kill at event {kill_at}: {event})"
        child.stdout.close(), child.stdin.close(), child.stderr.close()
        # Stage and start the next trial's committer; it imports and connects while this trial is checked.
        next_staged = stage(work / f"t{trial + 1}", step + 10, _files(rng, large), run_id=RUN)
        next_child = (
            _spawn_committer(next_staged, store_url, env, kill_points[trial + 1])
            if trial + 1 < len(kill_points)
            else None
        )
        summary.trials += 1
        summary.killed_mid_commit += not finished_first
        _check_visible(store, summary, step, label)
        latest = read_latest(store, RUN)
        if latest is not None and latest["step"] < latest_step:
            summary.latest_moved_back += 1
            summary.failures.append(f"{label}: LATEST moved back to {latest['step']} from {latest_step}")
        manifest, _ = read_staged_manifest(staged, RUN)
        found = store.remote_objects(remote_dir(store, RUN, step), list(manifest.files), deadline=None)
        complete = {e.path: e.size for e in manifest.files if matches(found.get(e.path), e)}
        summary.bytes_staged += manifest.num_bytes
        summary.bytes_complete_before_retry += sum(complete.values())
        outcome = commit_checkpoint(staged, store, RUN)
        summary.bytes_uploaded_on_retry += outcome.bytes_uploaded
        reuploaded = [path for path in outcome.uploaded if path in complete]
        summary.bytes_reuploaded_complete += sum(complete[path] for path in reuploaded)
        summary.bytes_landed_after_check += sum(
            e.size for e in manifest.files if e.path not in complete and e.path not in outcome.uploaded
        )
        if verify_checkpoint(store, RUN, checkpoint_name(step), full=True).verified and read_latest(store, RUN) == {
            "checkpoint": checkpoint_name(step),
            "step": step,
        }:
            summary.recovered += 1
        else:
            summary.failures.append(f"{label}: the retry did not leave a verified checkpoint with LATEST on it")
        latest_step = step
        staged, child = next_staged, next_child
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--large", action="store_true", help="add a 70 MiB file (multipart) to every checkpoint")
    parser.add_argument("--boundaries", action="store_true", help="first kill once at each event of a commit")
    args = parser.parse_args()
    from infra.services.s3_server import start_s3_server

    with tempfile.TemporaryDirectory(prefix="rankflow-crash-") as tmp:
        with start_s3_server(Path(tmp) / "s3") as server:
            server.create_bucket("crash")
            env = server.env()
            os.environ.update(env)
            summary = run_trials(
                "s3://crash/runs", Path(tmp) / "work", args.trials, args.seed, env, args.large, args.boundaries
            )
    print(json.dumps(summary.to_dict()))
    return 0 if not summary.failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
