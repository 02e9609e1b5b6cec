"""Backward state, one object per mode — retained, offloaded or replayed — and the planner that picks."""

from .base import BACKWARD_MODES, BackwardMode, BackwardState, BackwardStateError, NoGradientPathError, Rerun
from .estimates import GraphShape, SavedBytesModel
from .miss_reports import MissReports
from .offload import OffloadedGraph, OffloadHooks, OffloadTarget
from .planner import DEFAULT_OFFLOAD_BYTES_PER_S, MemoryPlanner, PlannerDecision
from .module_state import ModuleState
from .replay import ForwardStart, ReplayedGraph, ReplayMismatchError
from .retained import RetainedGraph

__all__ = ["BACKWARD_MODES", "DEFAULT_OFFLOAD_BYTES_PER_S", "BackwardMode", "BackwardState", "BackwardStateError",
           "ForwardStart", "GraphShape", "MemoryPlanner", "MissReports", "ModuleState", "NoGradientPathError",
           "OffloadHooks", "OffloadTarget", "OffloadedGraph", "PlannerDecision", "ReplayMismatchError", "ReplayedGraph",
           "RetainedGraph", "Rerun", "SavedBytesModel"]
