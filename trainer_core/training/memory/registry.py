"""`BACKWARD_STATES`: every backward mode by name, a state class per mode, in the order the planner considers them.

The trainer looks a mode up here, the config's `train.backward_mode` choices
are these names plus `PLANNER` (torch-free, in `trainer_core.registry_names`,
checked below), and the planner's candidates are these classes. Adding a mode
is one file (a class with the attributes of `base.BackwardState`), its entry
here and its name in `trainer_core.registry_names.BACKWARD_MODES`.
"""

from __future__ import annotations

from ...registry_names import BACKWARD_MODES, check_names
from .base import BackwardState
from .offload import OffloadedGraph
from .replay import ReplayedGraph
from .retained import RetainedGraph

BACKWARD_STATES: dict[str, type[BackwardState]] = {
    cls.mode: cls
    for cls in (RetainedGraph, OffloadedGraph, ReplayedGraph)  # type: ignore[misc]
}
"""Every backward mode by name, in the order the planner considers them."""
check_names("train.backward_mode", BACKWARD_MODES, BACKWARD_STATES)
