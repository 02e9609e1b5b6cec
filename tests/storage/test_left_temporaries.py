"""A process SIGKILLed while it writes into a local store leaves a temporary file; the rerun removes it.

The kill lands in a segment-state upload (infra/runs/run_state.py), whose retry
writes the objects again under other temporary names: before the sweep in the
publication's cleanup, only `rankflow checkpoints gc` removed what the killed
writer left. The reference is the store's directory itself, after a real kill.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from infra.publication.checkpoints import verify_checkpoint
from infra.publication.cleanup import cleanup_staging
from infra.publication.commit import commit_checkpoint
from infra.runs.run_state import publish_bundle, stored_bundle
from infra.store import open_store
from infra.store.durable import TEMP_MARKER
from tests.publication_helpers import RUN, random_files, stage
from tests.storage.processes import REPO_ROOT

UPLOAD = """
import sys
from pathlib import Path
from infra.runs.run_state import publish_bundle
from infra.store import open_store
run_dir, store_url, *paths = sys.argv[1:]
print("ready", flush=True)
publish_bundle(open_store(store_url), "{run}", Path(run_dir), "segment-0000", paths)
"""


def temporaries(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if TEMP_MARKER in p.name)


def kill_when_a_temporary_appears(process: subprocess.Popen, where: Path, timeout_s: float = 300.0) -> list[Path]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = temporaries(where) if where.is_dir() else []
        if found:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            # What the dead writer left, listed once it is dead: under load its other threads can
            # open another temporary between the listing above and the kill.
            return temporaries(where)
        if process.poll() is not None:
            raise AssertionError("the upload finished before a temporary was seen; use larger files")
        time.sleep(0.001)
    os.killpg(process.pid, signal.SIGKILL)
    raise AssertionError("no temporary appeared")


def test_a_killed_uploads_temporaries_are_removed_by_the_rerun_and_lease_writes_are_left(tmp_path):
    store_dir, run_dir = tmp_path / "store", tmp_path / "work" / RUN
    paths = []
    for name, data in random_files(3, 48 * 2**20, prefix="state/segment-0000/weights").items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_bytes(data)
        paths.append(name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    uploader = subprocess.Popen(
        [sys.executable, "-c", UPLOAD.format(run=RUN), str(run_dir), str(store_dir), *paths],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    assert uploader.stdout.readline().strip() == "ready"
    left = kill_when_a_temporary_appears(uploader, store_dir / RUN / "state")
    assert uploader.returncode == -signal.SIGKILL and all(p.exists() for p in left)
    # A lease write in flight by another process (one waiting for a lease holds none) is not ours to remove.
    waiting = store_dir / RUN / "leases" / f".run.json{TEMP_MARKER}4242-beef"
    waiting.parent.mkdir(parents=True, exist_ok=True)
    waiting.write_bytes(b"{}")

    # The rerun: the segment's state is uploaded again (the dead holder's finalizer lease is taken
    # over), then its checkpoint is committed and cleaned up.
    store = open_store(str(store_dir))
    publish_bundle(store, RUN, run_dir, "segment-0000", paths)
    assert stored_bundle(store, RUN, "segment-0000") is not None
    staged = stage(tmp_path, 10, random_files(2, 1000))
    commit_checkpoint(staged, store, RUN)
    outcome = cleanup_staging(staged, store, RUN)
    assert temporaries(store_dir / RUN) == [waiting]
    assert outcome.state == "CLEANED" and outcome.temporaries_removed == len(left)
    assert stored_bundle(store, RUN, "segment-0000") is not None
    assert verify_checkpoint(store, RUN, "step-00000010", full=True).verified
