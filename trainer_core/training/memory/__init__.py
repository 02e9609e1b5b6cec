"""Backward state, one object per mode — retained, offloaded or replayed — and the planner that picks.

`BACKWARD_STATES` (`registry.py`) is the one list of modes: the trainer looks
a mode up in it, the config's `train.backward_mode` choices are its keys plus
`PLANNER`, and the planner's candidates are its values.
"""

from ...registry_names import PLANNER
from .base import BackwardMode, BackwardState, BackwardStateError, ForwardRecording, NoGradientPathError, Rerun
from .costs import Evidence, PlanInputs
from .estimates import GraphShape, SavedBytesModel
from .miss_reports import MissReports
from .module_state import ModuleState
from .offload import OffloadedGraph, OffloadHooks, OffloadTarget
from .planner import DEFAULT_OFFLOAD_BYTES_PER_S, MemoryPlanner, PlannerDecision
from .registry import BACKWARD_STATES
from .replay import ForwardStart, ReplayedGraph, ReplayMismatchError
from .retained import RetainedGraph

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
