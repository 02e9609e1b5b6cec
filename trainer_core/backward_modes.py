"""The backward modes' names, torch-free: the choices of `train.backward_mode` before the trainer is imported.

The registry is `training.memory.BACKWARD_STATES` (a state class per mode). The
config is loaded by the CLI for every command, bad input included, and that
path must not import torch (seconds per process). So the names live here and
the registry is checked against them when it is built: registering a mode
without naming it here (or the other way round) fails at the trainer's import,
not silently in the config's choices.
"""

BACKWARD_MODES: tuple[str, ...] = ("retain", "offload", "replay")
"""Every backward mode by name, in the order the planner considers them (the registry's keys, in order)."""
PLANNER = "auto"
"""The config's name for "let the planner choose the mode of each forward"."""
