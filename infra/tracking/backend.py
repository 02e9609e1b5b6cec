"""What every tracking backend does: start (or resume) the run's record, log a step's metrics, tag, end, close."""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import Literal

RunEnd = Literal["FINISHED", "FAILED", "KILLED"]
"""How a rankflow run ended, in MLflow's words: completed, failed, or stopped (Ctrl-C, SIGTERM, a cancel)."""


class TrackingBackend(abc.ABC):
    """One run's record in a tracking backend, opened by `registry.open_backend` (its library imported then)."""

    def __init__(self, uri: str, experiment: str, run_id: str) -> None:
        self.uri, self.experiment, self.run_id = uri, experiment, run_id

    @abc.abstractmethod
    def start(self, params: Callable[[], Mapping[str, object]]) -> None:
        """Open the run's record (created on first use, the same one after that) and record the params (read only
        where the backend needs them: a record that exists already has its params)."""

    @abc.abstractmethod
    def logged_through(self) -> int | None:
        """The highest step whose metrics the backend holds for this run; None before the first."""

    @abc.abstractmethod
    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """The metrics of global optimizer step `step`."""

    @abc.abstractmethod
    def tag(self, key: str, value: str) -> None:
        """A run-level label (the newest committed checkpoint's URL)."""

    def end(self, status: RunEnd) -> None:  # noqa: B027 - a backend without a run status (TensorBoard) has nothing to do
        """Mark the run's record ended with `status`; a later resume of the run id marks it running again."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and let go; the record stays open for the next segment to resume."""


def flat_params(tree: Mapping[str, object], prefix: str = "") -> dict[str, str]:
    """A nested config as `section.key` -> value text, the form MLflow's and TensorBoard's params take."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flat_params(value, f"{name}."))
        else:
            flat[name] = "" if value is None else str(value)
    return flat
