"""A logical rank's random streams: seeded by (run, step, logical rank), and the caller's own streams left untouched.

Dropout (and any draw inside a logical rank's work) must not depend on which
process runs the logical rank, so each one runs under its own seed. The
caller's global streams must not depend on it either: a driver that draws
from torch's global RNG after a facade call (a shuffle, a token subsample,
noise) would otherwise draw from the stream of whichever logical rank its
process ran last — a different one at every world size, and on every
process of the same run. So the work runs under `torch.random.fork_rng`
and the caller's streams come back as they were, as at W = 1 with no facade.

Only the streams of the devices in use are forked and seeded: the CPU's, and
the trainer's accelerator's when it has one. Forking every CUDA device would
initialise (and cost a state copy on) each of them at every logical rank;
seeding every device (`torch.manual_seed`) would change the streams of
devices that are not restored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def model_device(model: torch.nn.Module) -> torch.device:
    """The device the model's parameters live on (the CPU for a model without parameters)."""
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


@contextlib.contextmanager
def caller_streams_kept(device: torch.device) -> Iterator[None]:
    """Run the body; then the CPU stream and `device`'s stream are back as they were (whatever the body drew)."""
    if device.type in ("cpu", "meta"):
        with torch.random.fork_rng(devices=[]):
            yield
        return
    module = torch.get_device_module(device.type)
    index = device.index if device.index is not None else module.current_device()
    with torch.random.fork_rng(devices=[index], device_type=device.type):
        yield


@contextlib.contextmanager
def logical_rank_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Run the body with the CPU stream and `device`'s stream seeded with `seed`; restore the caller's after."""
    with caller_streams_kept(device):
        torch.default_generator.manual_seed(seed)
        if device.type not in ("cpu", "meta"):
            module = torch.get_device_module(device.type)
            index = device.index if device.index is not None else module.current_device()
            # `manual_seed` seeds the current device's stream only (`manual_seed_all` would reach the others).
            with module.device(index) if hasattr(module, "device") else contextlib.nullcontext():
                module.manual_seed(seed)
        yield
