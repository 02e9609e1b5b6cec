"""The segment's progress records to the tracking backend, from a thread of its own, once per step.

Everything the backend does (its import, its server's answers, a timeout) happens on the sink's thread: the
segment task only queues records. An error is a warning and a count (`failures`: steps, params or tags that did
not reach the backend), never an exception; `close` waits a bounded time, so a dead server costs the segment at
most `close_timeout_s` after its launch.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from .backend import RunEnd, TrackingBackend
from .registry import open_backend, records_status

if TYPE_CHECKING:
    from tasks.outcomes import PlannedRun

CHECKPOINT_URL_TAG = "checkpoint_url"
_OPTIONAL = ("eval_loss", "stale_trajectories_dropped", "clip_fraction", "mean_importance_ratio")
_STOP = object()


def step_metrics(record: Mapping[str, object]) -> dict[str, float]:
    """A progress `step` record's metrics under the names every backend shows (None: not measured that step)."""
    metrics = {
        "loss": float(record["loss"]),  # pyright: ignore[reportArgumentType]
        "grad_norm": float(record["grad_norm"]),  # pyright: ignore[reportArgumentType]
        "learning_rate": float(record["learning_rate"]),  # pyright: ignore[reportArgumentType]
        "tokens_per_s": float(record["tokens_per_s"]),  # pyright: ignore[reportArgumentType]
        "skipped": 0.0 if record.get("stepped", True) else 1.0,
    }
    for name in _OPTIONAL:
        value = record.get(name)
        if value is not None:
            metrics[name] = float(value)  # pyright: ignore[reportArgumentType]
    return metrics


class TrackingSink:
    """Feed it progress records (`__call__`, the watchdog's `on_records`), tags; `close` when the launch is over."""

    def __init__(
        self,
        backend: Callable[[], TrackingBackend],
        params: Callable[[], Mapping[str, object]],
        warn: Callable[[str], None],
        close_timeout_s: float = 30.0,
    ) -> None:
        self._open, self._params, self._warn = backend, params, warn
        self._close_timeout_s = close_timeout_s
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._queued = 0  # items put and not yet taken up by the thread
        self._in_flight = False  # an item taken up whose backend call has not returned
        self._abandoned = threading.Event()
        """Set when `close` gave up waiting: the thread then calls the backend no more (a retried segment's sink
        owns the run's record from then on; a late call would log a step twice or make a second record)."""
        self.failures = 0
        self.logged = 0
        self._thread = threading.Thread(target=self._run, name="rankflow-tracking", daemon=True)
        self._thread.start()

    def __call__(self, records: list[dict]) -> None:
        for record in records:
            if record.get("event") == "step":
                self._put(("log", int(record["step"]), step_metrics(record)))

    def tag(self, key: str, value: str) -> None:
        self._put(("tag", key, value))

    def end(self, status: RunEnd) -> None:
        """Mark the run's record ended (after what is queued before it)."""
        self._put(("end", status))

    def close(self) -> int:
        """Wait (bounded) for what is queued to be logged; returns the failures, the abandoned items included."""
        self._queue.put(_STOP)
        self._thread.join(self._close_timeout_s)
        if self._thread.is_alive():
            with self._lock:
                self._abandoned.set()
                abandoned = self._queued + (1 if self._in_flight else 0)
                self.failures += abandoned
            self._warn(
                f"experiment tracking did not answer within {self._close_timeout_s:.0f}s; {abandoned} item(s) "
                "were not logged (the training is not affected)"
            )
        return self.failures

    def _put(self, item: tuple) -> None:
        with self._lock:
            self._queued += 1
        self._queue.put(item)

    def _take(self) -> tuple | None:
        """The next item, or None: stop (asked by `close`, or given up on by it)."""
        item = self._queue.get()
        with self._lock:
            if self._abandoned.is_set() or item is _STOP:
                return None  # what was still queued is counted by `close` already
            self._queued -= 1
            self._in_flight = True
        return item

    def _done(self) -> None:
        with self._lock:
            self._in_flight = False

    def _fail(self, what: str, error: BaseException) -> None:
        with self._lock:
            self.failures += 1
        if self.failures <= 3 or math.log2(self.failures).is_integer():  # the first few, then sparser
            self._warn(
                f"experiment tracking: {what} not logged ({type(error).__name__}: {error}); the training goes on "
                f"({self.failures} item(s) not logged so far)"
            )

    def _run(self) -> None:
        backend, through = self._started()
        while True:
            item = self._take()
            if item is None:
                break
            kind, *args = item
            try:
                if backend is None:
                    self._fail(f"{kind} {args[0]}", RuntimeError("the backend could not be opened"))
                elif kind == "log" and through is not None and args[0] <= through:
                    pass  # a resumed or retried segment: the backend holds this step already
                else:
                    getattr(backend, kind)(*args)  # log, tag or end
                    if kind == "log":
                        through = args[0]
                        self.logged += 1
            except Exception as error:  # noqa: BLE001 - any backend error is the backend's, not the training's
                self._fail(f"{kind} {args[0]}", error)
            finally:
                self._done()
        if backend is not None and not self._abandoned.is_set():
            try:
                backend.close()
            except Exception as error:  # noqa: BLE001
                self._fail("close", error)

    def _started(self) -> tuple[TrackingBackend | None, int | None]:
        try:
            backend = self._open()
            backend.start(self._params)
            through = backend.logged_through()
        except Exception as error:  # noqa: BLE001 - an outage at start: every item is counted as not logged
            self._fail("the run's record", error)
            return None, None
        return (None, None) if self._abandoned.is_set() else (backend, through)


def tracking_sink_for(
    planned: PlannedRun, warn: Callable[[str], None], close_timeout_s: float = 30.0
) -> TrackingSink | None:
    """The run's sink, or None where tracking.backend is "none"."""
    tracking = planned.tracking
    if tracking.backend == "none":
        return None
    assert tracking.uri is not None and tracking.experiment is not None  # resolved with the config's paths

    def params() -> Mapping[str, object]:
        from pathlib import Path

        from trainer_core.run.plan import read_plan

        return read_plan(Path(planned.run_dir)).run_config().model_dump(mode="json")

    uri, experiment, backend = tracking.uri, tracking.experiment, tracking.backend
    return TrackingSink(lambda: open_backend(backend, uri, experiment, planned.run_id), params, warn, close_timeout_s)


def end_tracked_run(planned: PlannedRun, status: RunEnd, warn: Callable[[str], None], timeout_s: float = 30.0) -> int:
    """Mark the run's record FINISHED, FAILED or KILLED as the flow run ends; returns the failures (0 or 1).

    MLflow shows a record RUNNING until this: without it every run looked alive forever. A resumed run's record
    is marked RUNNING again when its first sink opens it (`TrackingBackend.start`)."""
    if not records_status(planned.tracking.backend):
        return 0  # TensorBoard, W&B: nothing to end, and opening one would write an empty record
    sink = tracking_sink_for(planned, warn, close_timeout_s=timeout_s)
    if sink is None:
        return 0
    sink.end(status)
    return sink.close()


def tag_checkpoint(planned: PlannedRun, url: str, warn: Callable[[str], None]) -> int:
    """Record the newest committed checkpoint's URL on the run's record; returns the failures (0 or 1)."""
    sink = tracking_sink_for(planned, warn)
    if sink is None:
        return 0
    sink.tag(CHECKPOINT_URL_TAG, url)
    return sink.close()
