"""What the stages store and fetch so that `run.work_dir` is only a cache (infra/runs/run_state.py does the I/O).

- the plan stage publishes the plan and its shards;
- a segment publishes its training state and result before it reports
  success, and is reused (nothing trained) when that state already verifies
  in the store;
- a segment fetches the plan, its shard and the previous segment's state, and
  an export the plan and its segment's state (the state only when it has to
  launch), into the local run directory when they are not there (or do not
  match the store).
"""

from __future__ import annotations

from pathlib import Path

from infra.runs import ledger
from infra.runs.run_state import (
    PLAN_BUNDLE,
    Observer,
    StateSettings,
    fetch_bundle,
    publish_bundle,
    segment_bundle,
    stored_bundle,
)
from infra.store import open_store
from trainer_core.run.plan import PLAN_FILE, read_plan
from trainer_core.run.records import SegmentResult
from trainer_core.run.segment_main import segment_result_path
from trainer_core.run.state import state_dir_for

from .fencing import fenced_settings
from .outcomes import PlannedRun


def _settings(planned: PlannedRun) -> StateSettings:
    # Fenced by the run lease inside the upload too: a run whose lease was taken over stores no bundle.
    return fenced_settings(planned, StateSettings)


def _relative(run_dir: Path, path: Path) -> str:
    return path.relative_to(run_dir).as_posix()


def publish_plan(planned: PlannedRun) -> dict:
    """Store plan.json and every shard (shards already there with their digest are not uploaded again)."""
    run_dir = Path(planned.run_dir)
    plan = read_plan(run_dir)
    paths = [PLAN_FILE, *(segment.shard_file for segment in plan.segments)]
    figures = publish_bundle(
        open_store(planned.storage), planned.run_id, run_dir, PLAN_BUNDLE, paths, settings=_settings(planned)
    )
    ledger.record(run_dir, "run-state", "stored", **figures)
    return figures


def segment_state_files(run_dir: Path, segment_index: int) -> list[str]:
    """The files of a segment's bundle: its saved state and its result."""
    state_dir = state_dir_for(run_dir, segment_index)
    files = [p for p in sorted(state_dir.rglob("*")) if p.is_file()]
    return [_relative(run_dir, p) for p in files] + [_relative(run_dir, segment_result_path(run_dir, segment_index))]


def publish_segment_state(planned: PlannedRun, segment_index: int, observer: Observer | None = None) -> dict:
    run_dir = Path(planned.run_dir)
    figures = publish_bundle(
        open_store(planned.storage),
        planned.run_id,
        run_dir,
        segment_bundle(segment_index),
        segment_state_files(run_dir, segment_index),
        settings=_settings(planned),
        observer=observer,
    )
    ledger.record(run_dir, "run-state", "stored", segment=segment_index, **figures)
    return figures


def stored_segment_result(planned: PlannedRun, segment_index: int) -> SegmentResult | None:
    """The segment's result when its whole state is in the store and verifies; None otherwise.

    Only the small result file is fetched; the state itself is fetched by the
    stage that needs it.
    """
    run_dir = Path(planned.run_dir)
    store, bundle = open_store(planned.storage), segment_bundle(segment_index)
    if stored_bundle(store, planned.run_id, bundle) is None:
        return None
    result_path = segment_result_path(run_dir, segment_index)
    wanted = _relative(run_dir, result_path)
    fetch_bundle(store, planned.run_id, run_dir, bundle, only=lambda path: path == wanted)
    return SegmentResult.read(result_path)


def _fetch(planned: PlannedRun, bundle: str, only=None) -> dict:
    run_dir = Path(planned.run_dir)
    figures = fetch_bundle(open_store(planned.storage), planned.run_id, run_dir, bundle, only=only)
    if figures["num_files_fetched"]:
        ledger.record(run_dir, "run-state", "fetched", **figures)
    return figures


def fetch_plan_file(planned: PlannedRun) -> None:
    """plan.json, verified against the store."""
    _fetch(planned, PLAN_BUNDLE, only=lambda path: path == PLAN_FILE)


def fetch_segment_state(planned: PlannedRun, segment_index: int) -> None:
    """The training state segment `segment_index` saved (not its result), verified against the store."""
    prefix = _relative(Path(planned.run_dir), state_dir_for(Path(planned.run_dir), segment_index)) + "/"
    figures = _fetch(planned, segment_bundle(segment_index), only=lambda path: path.startswith(prefix))
    if not figures["num_files_kept"] + figures["num_files_fetched"]:
        # Its bundle keeps only the result: retention removed the state (infra/runs/state_retention.py).
        raise FileNotFoundError(
            f"the training state of segment {segment_index} of run {planned.run_id} was removed by retention "
            "(storage.keep_states = false) once a later checkpoint committed, and cannot be fetched; it comes back only by training "
            "again (another run.name, or a fresh store) — set storage.keep_states = true to keep every state"
        )


def fetch_segment_inputs(planned: PlannedRun, segment_index: int) -> None:
    """The plan, the segment's shard and the previous segment's state, verified against the store."""
    fetch_plan_file(planned)
    shard = read_plan(Path(planned.run_dir)).segments[segment_index].shard_file
    _fetch(planned, PLAN_BUNDLE, only=lambda path: path == shard)
    if segment_index > 0:
        fetch_segment_state(planned, segment_index - 1)
