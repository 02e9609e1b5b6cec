"""Backward state: retained, offloaded or replayed, and the planner that picks."""

from .offload import OffloadHooks
from .planner import BackwardMode, MemoryPlanner
from .replay import ReplayState

__all__ = ["BackwardMode", "MemoryPlanner", "OffloadHooks", "ReplayState"]
