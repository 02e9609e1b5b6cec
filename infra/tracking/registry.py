"""The tracking backends by `tracking.backend` name, each imported only when a run asks for it."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

from trainer_core.registry_names import TRACKING_BACKENDS, check_names

from .backend import TrackingBackend


@dataclass(frozen=True)
class BackendEntry:
    module: str
    """The module under infra.tracking that holds the backend."""
    cls: str
    library: str
    """The import its module needs."""
    extra: str
    """The package extra that installs that library."""
    records_status: bool = False
    """Whether its run record has a status to end (FINISHED, FAILED, KILLED); one without is not opened for it."""


BACKENDS: dict[str, BackendEntry] = {
    "mlflow": BackendEntry("mlflow_backend", "MlflowBackend", "mlflow", "mlflow", records_status=True),
    "tensorboard": BackendEntry("tensorboard_backend", "TensorBoardBackend", "tensorboard", "tensorboard"),
    "wandb": BackendEntry("wandb_backend", "WandbBackend", "wandb", "wandb"),
}
"""Every backend by its `tracking.backend` name (the config's choices: `TRACKING_BACKENDS`, checked here)."""
check_names("tracking.backend", TRACKING_BACKENDS, BACKENDS)


def missing_library(backend: str) -> str | None:
    """Why `backend` cannot run here (its library is not installed, with the fix), or None if it can."""
    entry = BACKENDS.get(backend)
    if entry is None or importlib.util.find_spec(entry.library) is not None:
        return None
    return (
        f"tracking.backend = {backend!r} needs the {entry.library} package, which is not installed; "
        f"pip install 'rankflow[{entry.extra}]', or set tracking.backend = \"none\""
    )


def records_status(backend: str) -> bool:
    """Whether `backend`'s run record has a status that the run's end must set."""
    entry = BACKENDS.get(backend)
    return entry is not None and entry.records_status


def open_backend(backend: str, uri: str, experiment: str, run_id: str) -> TrackingBackend:
    entry = BACKENDS[backend]
    module = importlib.import_module(f"{__package__}.{entry.module}")
    return getattr(module, entry.cls)(uri, experiment, run_id)
