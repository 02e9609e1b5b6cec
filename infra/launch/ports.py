"""Free TCP ports on the loopback interface (or a node's host), for torchrun's stores and local services.

A port found free can still be taken by another process before its server
binds it; callers retry a launch that fails on a port clash with a fresh draw.
"""

from __future__ import annotations

import random
import socket

__all__ = ["LOOPBACK", "pick_free_port", "port_is_free"]

LOOPBACK = "127.0.0.1"
# Below Linux's default ephemeral range (32768-60999), so outgoing connections
# rarely hold a port drawn from here.
_DEFAULT_PORT_RANGE = (20000, 32000)
_NUM_PORT_DRAWS = 200


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """Whether a TCP listener could bind `host:port` now (TIME_WAIT leftovers do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # Servers set SO_REUSEADDR (Go's listeners in weed, PostgreSQL, uvicorn), so a port
        # held only by TIME_WAIT connections is usable by them; mirror that to avoid false "busy".
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def pick_free_port(
    rng: random.Random | None = None, port_range: tuple[int, int] = _DEFAULT_PORT_RANGE, host: str = LOOPBACK
) -> int:
    """A random port in `[low, high)` that is free on `host` right now."""
    rng = rng or random.SystemRandom()
    for _ in range(_NUM_PORT_DRAWS):
        port = rng.randrange(*port_range)
        if port_is_free(port, host):
            return port
    raise RuntimeError(
        f"no free TCP port in {port_range[0]}-{port_range[1]} on {host} after {_NUM_PORT_DRAWS} "
        "draws; stop other local servers (`ss -ltn` lists them) and retry"
    )
