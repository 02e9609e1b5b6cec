"""Every process a test starts sees SIGINT as a user's terminal gives it, however the suite was started.

A suite started in the background without job control (`nohup … &` from a
script, some CI runners) runs with SIGINT ignored, and an ignored signal stays
ignored across fork and exec (`subprocess`'s `restore_signals` resets only
SIGPIPE and SIGXFSZ). Tests stop Prefect workers and servers as a user's
Ctrl-C does. Prefect 3's worker, started with SIGINT ignored, never stops on
it: its handler re-sends the signal to itself under the handler it found,
SIG_IGN (prefect/utilities/processutils `forward_signal_handler`), and
asyncio installs no handler of its own when SIGINT is ignored, so the worker
polls on. Python's own handler is restored for the session here; a caught
signal is reset to its default on exec, so each child starts as from a
terminal (and the session can be interrupted again).
"""

from __future__ import annotations

import signal


def pytest_configure() -> None:
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
