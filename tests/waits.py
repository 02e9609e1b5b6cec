"""Waiting for an event in a test: poll a condition until it holds, with a bound generous enough for a loaded machine.

A test waits for what it needs to have happened (a file written, a thread logged, a process gone), never for a fixed
time: the bound only stops a test that would otherwise hang, so it is set far above what any load makes it take.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

GENEROUS_S = 300.0
"""A bound for something that takes a second on a quiet machine: minutes, not seconds, so load never reaches it."""


def wait_for(condition: Callable[[], T], what: str, timeout_s: float = GENEROUS_S, poll_s: float = 0.02) -> T:
    """The first truthy value of `condition()`; fails the test naming `what` if none came within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (found := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)
    return found
