"""What the stages store and fetch so that `run.work_dir` is only a cache (infra/runs/run_state.py does the I/O).

- the plan stage publishes the plan and its shards;
- a segment's training state and result are published by the state upload
  (tasks/state_upload.py) beside the next segment, and a segment is reused
  (nothing trained) when its state already verifies in the store;
- a segment fetches the plan, its shard and the previous segment's state, and
  an export the plan and its segment's state (the state only when it has to
  launch), into the local run directory when they are not there (or do not
  match the store). The previous state saved on this machine is used as it
  lies while its files pass the trust rule of its local record
  (trainer_core/run/state_record.py), also before its upload has finished:
  no file is hashed on the way from one segment to the next.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from infra.runs import ledger
from infra.runs.run_state import (
    PLAN_BUNDLE,
    Observer,
    StateSettings,
    fetch_bundle,
    publish_bundle,
    read_bundle_manifest,
    segment_bundle,
    stored_bundle,
)
from infra.store import open_store
from infra.store.objects import SavedFile
from trainer_core.run.faults import upload_fault
from trainer_core.run.plan import PLAN_FILE, read_plan
from trainer_core.run.records import SegmentResult
from trainer_core.run.segment_main import segment_result_path
from trainer_core.run.state import state_dir_for
from trainer_core.run.state_record import LocalState, LocalStateChanged, forget_record

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
    if plan.eval_file is not None:
        paths.append(plan.eval_file)
    figures = publish_bundle(
        open_store(planned.storage), planned.run_id, run_dir, PLAN_BUNDLE, paths, settings=_settings(planned)
    )
    ledger.record(run_dir, "run-state", "stored", **figures)
    return figures


def segment_state_files(run_dir: Path, segment_index: int) -> list[str]:
    """The files of a segment's bundle: its saved state (as its local record lists it, if any) and its result."""
    state_dir = state_dir_for(run_dir, segment_index)
    local = LocalState.load(state_dir)
    if local is not None:
        files = [state_dir / entry.path for entry in local.record.files]
    else:
        files = [p for p in sorted(state_dir.rglob("*")) if p.is_file()]
    return [_relative(run_dir, p) for p in files] + [_relative(run_dir, segment_result_path(run_dir, segment_index))]


def saved_files(run_dir: Path, segment_index: int, local: LocalState | None = None) -> dict[str, SavedFile]:
    """The state's files that pass its local record's trust rule, with their recorded sha256 (by run-dir path).

    `local`: the state's record when the caller has it loaded already (else read here)."""
    state_dir = state_dir_for(run_dir, segment_index)
    local = local or LocalState.load(state_dir)
    if local is None:
        return {}
    prefix = _relative(run_dir, state_dir)
    found = {}
    for entry in local.record.files:
        if entry.sha256 is not None and local.untouched(entry.path):
            found[f"{prefix}/{entry.path}"] = SavedFile(entry.size, entry.sha256, entry.mtime_ns, entry.inode)
    return found


def discard_local_states(run_dir: Path, segment_index: int, num_segments: int) -> None:
    """Remove this machine's copies of segment `segment_index`'s state and every later one (each resumed from
    it), with their records and results: the store's copies are untouched, and what it lacks is trained again."""
    for index in range(segment_index, num_segments):
        state_dir = state_dir_for(run_dir, index)
        forget_record(state_dir)
        segment_result_path(run_dir, index).unlink(missing_ok=True)
        if state_dir.is_symlink() or state_dir.is_file():
            state_dir.unlink()
        elif state_dir.exists():
            shutil.rmtree(state_dir)


def publish_segment_state(planned: PlannedRun, segment_index: int, observer: Observer | None = None) -> dict:
    """Store the segment's state and result as its bundle (idempotent: what the store holds is not sent again).

    A state with a local record is checked by its trust rule and hashed once (digests recorded); one whose
    files are not those its save wrote is discarded here with every later local state (LocalStateChanged):
    it is never uploaded, and the rerun trains the segment again from the store."""
    run_dir = Path(planned.run_dir)
    local = LocalState.load(state_dir_for(run_dir, segment_index))
    if local is not None:
        try:
            local.digests()
        except LocalStateChanged:
            discard_local_states(run_dir, segment_index, planned.num_segments)
            raise
    figures = publish_bundle(
        open_store(planned.storage),
        planned.run_id,
        run_dir,
        segment_bundle(segment_index),
        segment_state_files(run_dir, segment_index),
        settings=_settings(planned),
        observer=observer or upload_fault(segment_index),
        saved=saved_files(run_dir, segment_index, local),  # the digests just recorded, not read again
    )
    if local is not None:
        local.restamp()  # a local store's hard links changed the files' ctime, nothing else
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


def saved_here(planned: PlannedRun, segment_index: int) -> SegmentResult | None:
    """The result of a segment trained on this machine whose upload had not finished, if its state may be used.

    A state with a local record counts when its files pass the trust rule (the state upload stores it); one
    that does not is discarded with the later local states (None: train it again). A state saved without a
    record (an older rankflow) is uploaded here first, as before records."""
    run_dir = Path(planned.run_dir)
    local = LocalState.load(state_dir_for(run_dir, segment_index))
    if local is None:
        publish_segment_state(planned, segment_index)
    else:
        try:
            local.check()
        except LocalStateChanged as changed:
            discard_local_states(run_dir, segment_index, planned.num_segments)
            ledger.record(run_dir, "segment", "discarded", segment=segment_index, reason=str(changed))
            return None
    return SegmentResult.read(segment_result_path(run_dir, segment_index))


def _fetch(planned: PlannedRun, bundle: str, only=None, saved: dict[str, SavedFile] | None = None) -> dict:
    run_dir = Path(planned.run_dir)
    figures = fetch_bundle(open_store(planned.storage), planned.run_id, run_dir, bundle, only=only, saved=saved)
    if figures["num_files_fetched"]:
        ledger.record(run_dir, "run-state", "fetched", **figures)
    return figures


def fetch_plan_file(planned: PlannedRun) -> None:
    """plan.json, verified against the store."""
    _fetch(planned, PLAN_BUNDLE, only=lambda path: path == PLAN_FILE)


def fetch_segment_state(planned: PlannedRun, segment_index: int, *, stored_only: bool = False) -> None:
    """The training state segment `segment_index` saved (not its result), verified against the store.

    Where its bundle is not in the store yet (its upload runs beside the next segment), the state this machine
    saved is used if it passes its local record's trust rule, unless `stored_only` (an export: a checkpoint
    is published only from a stored state); it is never used against a stored bundle it does not match."""
    run_dir = Path(planned.run_dir)
    state_dir = state_dir_for(run_dir, segment_index)
    bundle = segment_bundle(segment_index)
    local = None if stored_only else LocalState.load(state_dir)
    if local is not None and read_bundle_manifest(open_store(planned.storage), planned.run_id, bundle) is None:
        local.check()  # LocalStateChanged names what changed; nothing else holds this state yet
        return
    prefix = _relative(run_dir, state_dir) + "/"
    figures = _fetch(
        planned, bundle, only=lambda path: path.startswith(prefix), saved=saved_files(run_dir, segment_index)
    )
    if not figures["num_files_kept"] + figures["num_files_fetched"]:
        # Its bundle keeps only the result: retention removed the state (infra/runs/state_retention.py).
        raise FileNotFoundError(
            f"the training state of segment {segment_index} of run {planned.run_id} was removed by retention "
            "(storage.keep_states = false) once a later checkpoint committed, and cannot be fetched; it comes back "
            "only by training again (another run.name, or a fresh store) — set storage.keep_states = true to keep "
            "every state"
        )


def fetch_segment_inputs(planned: PlannedRun, segment_index: int) -> None:
    """The plan, the segment's shard (and the held-out rows, where the run has them) and the previous segment's
    state, verified against the store."""
    fetch_plan_file(planned)
    plan = read_plan(Path(planned.run_dir))
    needed = {plan.segments[segment_index].shard_file, plan.eval_file}
    _fetch(planned, PLAN_BUNDLE, only=lambda path: path in needed)
    if segment_index > 0:
        fetch_segment_state(planned, segment_index - 1)
