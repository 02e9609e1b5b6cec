"""Timing device work for the memory planner: what a forward, a pack or a restore really costs.

On CUDA, kernels and copies run asynchronously: a host clock read right after
issuing them measures the issuing, not the work. `Stopwatch` therefore
synchronises the device before it starts and before it stops, and
`CopyTimer` brackets each copy with CUDA events on the current stream (no
synchronisation per copy; one wait on the last event when the total is read).
On the CPU both use the host clock. Timing is only switched on while the
planner has a budget to plan for, so untimed training pays nothing.
"""

from __future__ import annotations

import contextlib
import time

import torch


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Seconds of device work inside a `with` block (0 when not `enabled`)."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self._device, self._enabled = device, enabled
        self._started = 0.0
        self.seconds = 0.0

    def __enter__(self) -> "Stopwatch":
        if self._enabled:
            _synchronize(self._device)
            self._started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self._enabled and exc[0] is None:
            _synchronize(self._device)
            self.seconds = time.perf_counter() - self._started


class CopyTimer:
    """Accumulated seconds of many copies (offload packs, or restores)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._host_s = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def timing(self, device: torch.device):
        if not self.enabled:
            yield
            return
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
            return
        started = time.perf_counter()
        yield
        self._host_s += time.perf_counter() - started

    def seconds(self) -> float:
        """The total so far; on CUDA this waits for the last timed copy to finish."""
        if self._events:
            self._events[-1][1].synchronize()
            self._host_s += sum(start.elapsed_time(end) for start, end in self._events) / 1000.0
            self._events.clear()
        return self._host_s

    def take(self) -> float:
        """The total so far, and start again from zero."""
        seconds, self._host_s = self.seconds(), 0.0
        return seconds
