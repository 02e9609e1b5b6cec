"""The runs a store holds, each with its LATEST, its number of checkpoints and its last ledger line.

A run is a top-level prefix of the store holding any of what a run writes
there (LATEST, checkpoints/, run-state/, publications/, leases/, the ledger);
anything else (another tool's files, the pre-flight's probes) is not a run.
The summary is cheap on purpose, a few requests per run whatever its size:
one listing of the run, LATEST read, one listing of checkpoints/ (a
checkpoint counts when its MANIFEST.json is there; `rankflow checkpoints
list RUN_ID` verifies them), and the ledger's last few kB, never all of it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from infra.publication.latest import latest_path, parse_latest
from infra.publication.manifests import (
    CHECKPOINTS_DIR,
    LATEST_FILE,
    MANIFEST_FILE,
    PUBLICATIONS_DIR,
    checkpoints_dir_key,
    step_of,
)
from infra.runs.ledger import LEDGER_FILE
from infra.runs.run_state import RUN_STATE_DIR
from infra.store.base import ObjectStore
from infra.store.lease import LEASES_DIR

_RUN_ENTRIES = frozenset({LATEST_FILE, LEDGER_FILE, CHECKPOINTS_DIR, RUN_STATE_DIR, PUBLICATIONS_DIR, LEASES_DIR})
_LEDGER_TAIL_BYTES = 64 * 1024
"""How much of the ledger's end is read for its last line (a line is a few hundred bytes)."""


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    latest: str | None
    """The checkpoint LATEST names (None: absent or unreadable), as written, not verified."""
    latest_step: int | None
    num_checkpoints: int
    """Checkpoint directories holding a manifest (committed; not verified here)."""
    last_stage: str | None
    last_status: str | None
    last_time: float | None
    """The stored ledger's last line (None: no ledger stored, or its end does not parse)."""

    def to_dict(self) -> dict:
        return asdict(self)


def _latest(store: ObjectStore, run_id: str) -> tuple[str | None, int | None]:
    found = store.get(store.key_of(latest_path(store, run_id)))
    if found is None:
        return None, None
    pointer, _ = parse_latest(found.data)
    return (pointer.checkpoint, pointer.step) if pointer else (None, None)


def _num_checkpoints(store: ObjectStore, run_id: str) -> int:
    names = set()
    for path in store.list(checkpoints_dir_key(run_id)):
        parts = path.split("/")
        if len(parts) == 2 and parts[1] == MANIFEST_FILE and step_of(parts[0]) is not None:
            names.add(parts[0])
    return len(names)


def _last_ledger_line(store: ObjectStore, run_id: str) -> dict | None:
    """The ledger's last whole line that parses, read from its end (a longer window only for a very long line)."""
    key = store.key(run_id, LEDGER_FILE)
    found = store.head([key]).get(key)
    if found is None:
        return None
    size = found.size
    window = _LEDGER_TAIL_BYTES
    while True:
        start = max(0, size - window)
        lines = store.read_range(key, start, size).decode(errors="replace").splitlines()
        if start > 0:
            lines = lines[1:]  # cut by the window's start
        for line in reversed(lines):
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a half-written line (a full disk, a kill): the one before it is the last outcome
            if isinstance(entry, dict):
                return entry
        if start == 0:
            return None
        window *= 4


def list_runs(store: ObjectStore) -> list[RunSummary]:
    """Every run in the store, by run id."""
    with store.errors(f"listing of the runs at {store.url}"):
        summaries = []
        for run_id in store.children("", dirs_only=True):
            if run_id.startswith(".") or not set(store.children(run_id)) & _RUN_ENTRIES:
                continue
            latest, latest_step = _latest(store, run_id)
            last = _last_ledger_line(store, run_id) or {}
            summaries.append(
                RunSummary(
                    run_id,
                    latest,
                    latest_step,
                    _num_checkpoints(store, run_id),
                    last.get("stage"),
                    last.get("status"),
                    last.get("time"),
                )
            )
    return summaries
