"""The state upload: a segment's saved state and result to the store, beside the next segment's training.

A segment's launch ends with its state durable on local disk (fsync'd,
renamed into place, fingerprinted: trainer_core/run/state_record.py); the next
segment starts from it at once, and this task uploads it meanwhile, as its own
task run in the run's graph with its own retries. The flow keeps one upload in
flight per run (`StateUploads`: upload K+1 waits for upload K) and waits for
every upload before it publishes a checkpoint and before it reports, so
nothing is committed or reported from a state the store does not hold.

Idempotent and cheap when done: a segment whose bundle is already complete in
the store (`stored_segment_result`: the manifest, every object confirmed)
uploads nothing, so a node flow run that uploaded it itself, a rerun, or a
retry after the manifest landed cost one check. Its files are hashed once,
here (the digests go into the local record and the bundle manifest). A
state that is neither in the store nor here, or whose files are not those its
save wrote, fails the upload; its local copies are discarded, so the rerun
trains again exactly what the store lacks.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect.futures import PrefectFuture
from prefect.runtime import task_run

from infra.runs import ledger
from trainer_core.run.segment_main import segment_result_path
from trainer_core.run.state import has_state, state_dir_for

from . import upload_hold
from .outcomes import PlannedRun
from .retry_policy import retry_unless_fenced
from .run_state import publish_segment_state, stored_segment_result
from .stage import Stage, stage_task


def upload_state_fn(planned: PlannedRun, segment_index: int) -> dict:
    """Store segment `segment_index`'s state and result unless the store holds them already; returns figures.

    Held first while the next segment loads the state (`tasks.upload_hold`)."""
    run_dir = Path(planned.run_dir)
    # Fenced before the hold too: a run lease lost is told at once, not after the hold.
    attempt = Stage.enter(planned, "state-upload", f"state upload of segment {segment_index}")
    held_s = upload_hold.wait_for_release(run_dir, segment_index)
    attempt.fence()
    started = time.perf_counter()
    if stored_segment_result(planned, segment_index) is not None:
        return {
            "segment": segment_index,
            "already_stored": True,
            "upload_s": time.perf_counter() - started,
            "held_s": held_s,
        }
    state_dir = state_dir_for(run_dir, segment_index)
    if not (has_state(state_dir) and segment_result_path(run_dir, segment_index).is_file()):
        raise FileNotFoundError(
            f"segment {segment_index}'s state is neither in the store nor in {state_dir} (removed or never saved); "
            "rerun the run: the segment is trained again from the last state in the store"
        )
    figures = publish_segment_state(planned, segment_index)
    return {
        "segment": segment_index,
        "already_stored": False,
        "upload_s": time.perf_counter() - started,
        "held_s": held_s,
        **figures,
    }


def _run_name() -> str:
    return f"state-upload-{task_run.parameters['segment_index']}"


@stage_task(
    "state-upload",
    run_name=_run_name,
    retries=3,
    retry_delay_seconds=[2, 10, 30],
    retry_condition_fn=retry_unless_fenced,
)
def upload_state(planned: PlannedRun, segment_index: int) -> dict:
    return upload_state_fn(planned, segment_index)


class StateUploads:
    """The run's state uploads, one in flight at a time, each submitted after its segment.

    `after(K)` submits the upload of segment K behind the previous upload, held until segment K+1 has loaded the
    state where K+1 follows on this node (`tasks.upload_hold`); `wait()` lets every held upload start, then
    blocks until every upload submitted so far is stored (raising the first failure), and returns the seconds
    the flow waited: what the uploads still cost on the critical path. Used as a context manager, it lets every
    held upload start when the flow leaves it, however it leaves.
    """

    def __init__(self, planned: PlannedRun) -> None:
        self.planned = planned
        self._futures: list[PrefectFuture] = []
        self.waited_s = 0.0

    def after(self, segment_index: int) -> None:
        self._raise_failed()  # a failed upload stops the run at the next segment, not only at its end
        previous = self._futures[-1:]
        if segment_index + 1 < self.planned.num_segments and self.planned.train.nnodes == 1:
            upload_hold.hold(self.planned.run_dir, segment_index)  # released by segment K+1's first step
        self._futures.append(upload_state.submit(self.planned, segment_index, wait_for=previous))

    def wait(self) -> float:
        upload_hold.release_all(self.planned.run_dir)  # waited for now: nothing is gained by holding them
        started = time.perf_counter()
        for future in self._futures:
            future.result()  # raises the upload's failure (or its upstream's, which ran first)
        waited = time.perf_counter() - started
        self.waited_s += waited
        if waited > 0.05:
            ledger.record(Path(self.planned.run_dir), "state-upload", "waited", waited_s=round(waited, 3))
        return waited

    def __enter__(self) -> StateUploads:
        return self

    def __exit__(self, *_exc: object) -> None:
        upload_hold.release_all(self.planned.run_dir)

    def _raise_failed(self) -> None:
        for future in self._futures:
            if future.state.is_failed() or future.state.is_crashed():
                future.result()
