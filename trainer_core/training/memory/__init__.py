"""Backward state, one object per mode — retained, offloaded or replayed — and the planner that picks."""

from .base import BACKWARD_MODES, BackwardMode, BackwardState, Rerun
from .offload import OffloadedGraph, OffloadHooks, OffloadTarget
from .planner import MemoryPlanner
from .replay import ReplayedGraph
from .retained import RetainedGraph

__all__ = ["BACKWARD_MODES", "BackwardMode", "BackwardState", "MemoryPlanner", "OffloadHooks", "OffloadTarget",
           "OffloadedGraph", "ReplayedGraph", "RetainedGraph", "Rerun"]
