"""Backward state, one object per mode — retained, offloaded or replayed — and the planner that picks."""

from .base import BACKWARD_MODES, BackwardMode, BackwardState, Rerun
from .estimates import GraphShape, SavedBytesModel
from .miss_reports import MissReports
from .offload import OffloadedGraph, OffloadHooks, OffloadTarget
from .planner import DEFAULT_OFFLOAD_BYTES_PER_S, MemoryPlanner, PlannerDecision
from .replay import ReplayedGraph
from .retained import RetainedGraph

__all__ = ["BACKWARD_MODES", "DEFAULT_OFFLOAD_BYTES_PER_S", "BackwardMode", "BackwardState", "GraphShape",
           "MemoryPlanner", "MissReports", "OffloadHooks", "OffloadTarget", "OffloadedGraph", "PlannerDecision",
           "ReplayedGraph", "RetainedGraph", "Rerun", "SavedBytesModel"]
