"""Backward state, one object per mode — retained, offloaded or replayed — and the planner that picks.

`BACKWARD_STATES` is the one list of modes: the trainer looks a mode up in it,
the config's `train.backward_mode` choices are its keys plus `PLANNER`, and the
planner's candidates are its values. Adding a mode is one file (a class with
the attributes of `base.BackwardState`), one entry here and its name in
`trainer_core.backward_modes` (torch-free, for the config; checked below).
"""

from ...backward_modes import BACKWARD_MODES, PLANNER
from .base import BackwardMode, BackwardState, BackwardStateError, ForwardRecording, NoGradientPathError, Rerun
from .costs import Evidence, PlanInputs
from .estimates import GraphShape, SavedBytesModel
from .miss_reports import MissReports
from .module_state import ModuleState
from .offload import OffloadedGraph, OffloadHooks, OffloadTarget
from .replay import ForwardStart, ReplayedGraph, ReplayMismatchError
from .retained import RetainedGraph

BACKWARD_STATES: dict[str, type[BackwardState]] = {
    cls.mode: cls
    for cls in (RetainedGraph, OffloadedGraph, ReplayedGraph)  # type: ignore[misc]
}
"""Every backward mode by name, in the order the planner considers them."""
# The config offers the torch-free names: they must be the registry's, in its order.
if tuple(BACKWARD_STATES) != BACKWARD_MODES:
    raise ImportError(
        f"trainer_core.backward_modes.BACKWARD_MODES {BACKWARD_MODES} is not the registry's modes "
        f"{tuple(BACKWARD_STATES)}"
    )

# The planner iterates the registry: it is imported once the registry exists.
from .planner import DEFAULT_OFFLOAD_BYTES_PER_S, MemoryPlanner, PlannerDecision  # noqa: E402

__all__ = [
    "BACKWARD_STATES",
    "DEFAULT_OFFLOAD_BYTES_PER_S",
    "PLANNER",
    "BackwardMode",
    "BackwardState",
    "BackwardStateError",
    "Evidence",
    "ForwardRecording",
    "ForwardStart",
    "GraphShape",
    "MemoryPlanner",
    "MissReports",
    "ModuleState",
    "NoGradientPathError",
    "OffloadHooks",
    "OffloadTarget",
    "OffloadedGraph",
    "PlanInputs",
    "PlannerDecision",
    "ReplayMismatchError",
    "ReplayedGraph",
    "RetainedGraph",
    "Rerun",
    "SavedBytesModel",
]
